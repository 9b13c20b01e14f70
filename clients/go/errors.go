package kvgen

import (
	"context"
	"fmt"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// FieldViolation names a request field the server refused and why (google.rpc.BadRequest).
type FieldViolation struct {
	Field       string
	Description string
}

// Error is a failed call: its gRPC code and message, with the server's details decoded.
// errors.Is(err, context.Canceled) and errors.Is(err, context.DeadlineExceeded) hold for calls
// ended by their context.
type Error struct {
	Code    codes.Code
	Message string
	// Violations: for InvalidArgument, every field the server refused.
	Violations []FieldViolation
	// RetryAfter: for ResourceExhausted (a full queue), how long to wait before trying again.
	RetryAfter time.Duration
	status     *status.Status
}

func (e *Error) Error() string {
	msg := fmt.Sprintf("kvgen: %s: %s", e.Code, e.Message)
	if len(e.Violations) > 0 {
		parts := make([]string, len(e.Violations))
		for i, v := range e.Violations {
			parts[i] = v.Field + ": " + v.Description
		}
		msg += " (" + strings.Join(parts, "; ") + ")"
	}
	return msg
}

// GRPCStatus lets grpc/status.FromError see the original status.
func (e *Error) GRPCStatus() *status.Status { return e.status }

// Unwrap maps a cancelled or timed-out call to the context error that caused it.
func (e *Error) Unwrap() error {
	switch e.Code {
	case codes.Canceled:
		return context.Canceled
	case codes.DeadlineExceeded:
		return context.DeadlineExceeded
	}
	return nil
}

// Retryable: the call may succeed if sent again (the queue was full, or the server is starting
// or draining).
func (e *Error) Retryable() bool {
	return e.Code == codes.ResourceExhausted || e.Code == codes.Unavailable
}

// wrap turns a gRPC error into *Error (nil stays nil).
func wrap(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	e := &Error{Code: st.Code(), Message: st.Message(), status: st}
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				e.Violations = append(e.Violations, FieldViolation{v.GetField(), v.GetDescription()})
			}
		case *errdetails.RetryInfo:
			if rd := d.GetRetryDelay(); rd != nil {
				e.RetryAfter = time.Duration(rd.GetSeconds())*time.Second + time.Duration(rd.GetNanos())
			}
		}
	}
	return e
}

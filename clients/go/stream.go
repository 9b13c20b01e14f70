package kvgen

import (
	"context"
	"errors"
	"io"

	"kvgen.dev/kvgen/kvgenv1"
)

// Stream iterates over a request's deltas:
//
//	for s.Next() {
//		fmt.Print(s.Delta().Text)
//	}
//	if err := s.Err(); err != nil { ... }
type Stream struct {
	call   kvgenv1.Generator_GenerateStreamClient
	cancel context.CancelFunc
	delta  Delta
	err    error
	done   bool
}

// Next waits for the next delta; false at the end of the stream or on an error (see Err).
func (s *Stream) Next() bool {
	if s.done {
		return false
	}
	m, err := s.call.Recv()
	if err != nil {
		s.done = true
		s.cancel()
		if !errors.Is(err, io.EOF) {
			s.err = wrap(err)
		}
		return false
	}
	s.delta = deltaOf(m)
	return true
}

// Delta is the delta Next moved to.
func (s *Stream) Delta() Delta { return s.delta }

// Err is the error that ended the stream (nil at its normal end).
func (s *Stream) Err() error { return s.err }

// Close stops the stream: the server cancels the generation and frees its KV blocks.
func (s *Stream) Close() {
	s.done = true
	s.cancel()
}

// Collect reads the rest of the stream into one Response.
func (s *Stream) Collect() (*Response, error) {
	r := &Response{}
	for s.Next() {
		r.add(s.Delta())
	}
	return r, s.Err()
}

// add appends a delta of the response's stream to it.
func (r *Response) add(d Delta) {
	r.Text += d.Text
	r.TokenIDs = append(r.TokenIDs, d.TokenIDs...)
	r.Logprobs = append(r.Logprobs, d.Logprobs...)
	if d.FinishReason != 0 {
		r.FinishReason, r.MatchedStop = d.FinishReason, d.MatchedStop
	}
	if d.Usage != nil {
		r.Usage = *d.Usage
	}
}

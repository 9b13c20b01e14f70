package kvgen

import (
	"context"
	"errors"
	"io"

	"google.golang.org/grpc/status"

	"kvgen.dev/kvgen/kvgenv1"
)

// BatchResult is one request's outcome in a batch: a Response or an Err (*Error).
type BatchResult struct {
	Response *Response
	Err      error
}

// Batch runs every request together (the scheduler batches them); one bad request fails alone.
// Results are in request order.
func (c *Client) Batch(ctx context.Context, reqs []Request) ([]BatchResult, error) {
	resp, err := c.rpc.BatchGenerate(c.outgoing(ctx, ""), batchOf(reqs))
	if err != nil {
		return nil, wrap(err)
	}
	out := make([]BatchResult, len(resp.Results))
	for i, r := range resp.Results {
		if st := r.GetError(); st != nil {
			out[i].Err = wrap(status.ErrorProto(st))
		} else {
			out[i].Response = responseOf(r.GetResponse())
		}
	}
	return out, nil
}

func batchOf(reqs []Request) *kvgenv1.BatchGenerateRequest {
	msg := &kvgenv1.BatchGenerateRequest{}
	for _, r := range reqs {
		msg.Requests = append(msg.Requests, r.proto())
	}
	return msg
}

// BatchDelta is one message of a batch stream: entry Index's next Delta, or the Err (*Error) that
// ended that entry (nothing more comes for it; the other entries go on).
type BatchDelta struct {
	Index  int // the entry's position in the batch
	Sample int // which of the entry's samples the delta belongs to (0 unless its request asks for n > 1)
	Delta  Delta
	Err    error
}

// BatchStream iterates over a batch's messages as they are produced, each entry's in order and the
// entries' interleaved:
//
//	for s.Next() {
//		d := s.Delta()
//		if d.Err != nil { ... entry d.Index failed ... } else { fmt.Print(d.Delta.Text) }
//	}
//	if err := s.Err(); err != nil { ... the call failed ... }
type BatchStream struct {
	call    kvgenv1.Generator_BatchGenerateStreamClient
	cancel  context.CancelFunc
	delta   BatchDelta
	err     error
	done    bool
	entries int
}

// BatchStream runs every request together, as Batch does, and streams each one's deltas. Close the
// stream (or cancel ctx, or let its deadline pass) to stop every entry.
func (c *Client) BatchStream(ctx context.Context, reqs []Request) (*BatchStream, error) {
	ctx, cancel := context.WithCancel(ctx)
	call, err := c.rpc.BatchGenerateStream(c.outgoing(ctx, ""), batchOf(reqs))
	if err != nil {
		cancel()
		return nil, wrap(err)
	}
	return &BatchStream{call: call, cancel: cancel, entries: len(reqs)}, nil
}

// Next waits for the next message; false at the end of the stream or on an error (see Err).
func (s *BatchStream) Next() bool {
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
	s.delta = BatchDelta{Index: int(m.Index)}
	if st := m.GetError(); st != nil {
		s.delta.Err = wrap(status.ErrorProto(st))
	} else {
		s.delta.Delta, s.delta.Sample = deltaOf(m.GetResponse()), int(m.GetResponse().GetIndex())
	}
	return true
}

// Delta is the message Next moved to.
func (s *BatchStream) Delta() BatchDelta { return s.delta }

// Err is the error that ended the whole call (nil at its normal end; an entry's own error is its
// BatchDelta's Err).
func (s *BatchStream) Err() error { return s.err }

// Close stops the call: the server cancels every entry and frees their KV blocks.
func (s *BatchStream) Close() {
	s.done = true
	s.cancel()
}

// Collect reads the rest of the stream into one result per request, in order, as Batch returns
// them (an entry of n > 1 samples gives its sample 0).
func (s *BatchStream) Collect() ([]BatchResult, error) {
	out := make([]BatchResult, s.entries)
	for i := range out {
		out[i].Response = &Response{}
	}
	for s.Next() {
		d := s.Delta()
		if d.Index < 0 || d.Index >= len(out) {
			continue // not an entry of this batch: a server newer than this client
		}
		if d.Err != nil {
			out[d.Index] = BatchResult{Err: d.Err}
		} else if r := out[d.Index].Response; r != nil && d.Sample == 0 {
			r.add(d.Delta)
		}
	}
	return out, s.Err()
}

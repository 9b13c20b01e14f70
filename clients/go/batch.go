package kvgen

import (
	"context"

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
	msg := &kvgenv1.BatchGenerateRequest{}
	for _, r := range reqs {
		msg.Requests = append(msg.Requests, r.proto())
	}
	resp, err := c.rpc.BatchGenerate(c.outgoing(ctx, ""), msg)
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

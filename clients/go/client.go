// Package kvgen is a Go client for kvgen.v1.Generator, the kvgen text-generation service.
//
//	c, err := kvgen.Dial("localhost:50051", kvgen.WithAPIKey(os.Getenv("KVGEN_API_KEY")))
//	defer c.Close()
//	s, err := c.Stream(ctx, kvgen.Request{Messages: []kvgen.Message{{Role: "user", Content: "Hi!"}}})
//	for s.Next() {
//		fmt.Print(s.Delta().Text)
//	}
//	err = s.Err()
//
// Cancelling ctx (or its deadline passing) cancels the call on the server, which stops the
// generation and frees its KV blocks at once. Errors are *Error, with the server's BadRequest
// field violations and RetryInfo decoded.
package kvgen

import (
	"context"
	"crypto/tls"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"

	"kvgen.dev/kvgen/kvgenv1"
)

// MaxReceiveBytes: the server sends up to MAX_SEND_BYTES (64 MiB by default); gRPC clients
// accept 4 MB unless told.
const MaxReceiveBytes = 64 << 20

// SessionHeader carries a session's id on each of its calls, so that a mesh routes them all to
// the replica that holds the session.
const SessionHeader = "x-session-id"

// Client talks to one kvgen server (or a mesh in front of several). Safe for concurrent use.
type Client struct {
	conn   *grpc.ClientConn
	rpc    kvgenv1.GeneratorClient
	apiKey string
}

type options struct {
	apiKey string
	tls    *tls.Config
	dial   []grpc.DialOption
}

// Option configures Dial.
type Option func(*options)

// WithAPIKey sends `authorization: Bearer <key>` on every call (the server's API_KEY).
func WithAPIKey(key string) Option { return func(o *options) { o.apiKey = key } }

// WithTLS speaks TLS with cfg (its RootCAs verify the server; Certificates are this client's,
// for a server that requires one).
func WithTLS(cfg *tls.Config) Option { return func(o *options) { o.tls = cfg } }

// WithDialOptions adds raw gRPC dial options (interceptors, keepalive...).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dial = append(o.dial, opts...) }
}

// Dial opens a channel to target (host:port). It does not wait for the server: the first call does.
func Dial(target string, opts ...Option) (*Client, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	dial := []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxReceiveBytes))}
	if o.tls != nil {
		dial = append(dial, grpc.WithTransportCredentials(credentials.NewTLS(o.tls)))
	} else {
		dial = append(dial, grpc.WithInsecure())
	}
	conn, err := grpc.Dial(target, append(dial, o.dial...)...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, rpc: kvgenv1.NewGeneratorClient(conn), apiKey: o.apiKey}, nil
}

// Close closes the channel; calls in flight are cancelled.
func (c *Client) Close() error { return c.conn.Close() }

// Raw is the generated stub, for what the wrapper does not cover.
func (c *Client) Raw() kvgenv1.GeneratorClient { return c.rpc }

// outgoing adds the API key and, for a session's call, its routing header.
func (c *Client) outgoing(ctx context.Context, sessionID string) context.Context {
	var kv []string
	if c.apiKey != "" {
		kv = append(kv, "authorization", "Bearer "+c.apiKey)
	}
	if sessionID != "" {
		kv = append(kv, SessionHeader, sessionID)
	}
	if len(kv) == 0 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// Generate runs one request to completion.
func (c *Client) Generate(ctx context.Context, req Request) (*Response, error) {
	msg := req.proto()
	r, err := c.rpc.Generate(c.outgoing(ctx, msg.SessionId), msg)
	if err != nil {
		return nil, wrap(err)
	}
	return responseOf(r), nil
}

// Stream starts one request and returns its deltas as they are produced. Close the stream (or
// cancel ctx) to stop the generation early.
func (c *Client) Stream(ctx context.Context, req Request) (*Stream, error) {
	msg := req.proto()
	ctx, cancel := context.WithCancel(ctx)
	call, err := c.rpc.GenerateStream(c.outgoing(ctx, msg.SessionId), msg)
	if err != nil {
		cancel()
		return nil, wrap(err)
	}
	return &Stream{call: call, cancel: cancel}, nil
}

// ModelInfo describes the served model and its KV cache.
func (c *Client) ModelInfo(ctx context.Context) (*kvgenv1.GetModelInfoResponse, error) {
	r, err := c.rpc.GetModelInfo(c.outgoing(ctx, ""), &kvgenv1.GetModelInfoRequest{})
	return r, wrap(err)
}

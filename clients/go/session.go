package kvgen

import (
	"context"
	"crypto/rand"
	"encoding/hex"

	"kvgen.dev/kvgen/kvgenv1"
)

// Session keeps its conversation's KV blocks on the server between calls: each turn only
// prefills what is new. Its turns run one after another.
type Session struct {
	ID string
	c  *Client
}

// SessionOption configures CreateSession.
type SessionOption func(*kvgenv1.CreateSessionRequest)

// SessionAdapter runs every turn of the session with the LoRA adapter of that name (as
// Request.Adapter); one not loaded fails CreateSession with NotFound.
func SessionAdapter(name string) SessionOption {
	return func(r *kvgenv1.CreateSessionRequest) { r.Adapter = name }
}

// SessionKVCompress runs every turn of the session with that KV compression ("off", "mean",
// "sink-heavy", as Request.KVCompress); a turn may then only name the same.
func SessionKVCompress(method string) SessionOption {
	return func(r *kvgenv1.CreateSessionRequest) { r.KvCompress = method }
}

// CreateSession opens a session under id (empty: a random one chosen here, so that even the
// CreateSession call is routed by it to the replica its turns will go to).
func (c *Client) CreateSession(ctx context.Context, id string, opts ...SessionOption) (*Session, error) {
	if id == "" {
		var b [16]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, err
		}
		id = hex.EncodeToString(b[:])
	}
	msg := &kvgenv1.CreateSessionRequest{SessionId: id}
	for _, o := range opts {
		o(msg)
	}
	r, err := c.rpc.CreateSession(c.outgoing(ctx, id), msg)
	if err != nil {
		return nil, wrap(err)
	}
	return &Session{ID: r.SessionId, c: c}, nil
}

// Generate runs one turn: Messages are appended to the conversation; a Prompt or TokenIDs
// continue its token history.
func (s *Session) Generate(ctx context.Context, req Request) (*Response, error) {
	req.sessionID = s.ID
	return s.c.Generate(ctx, req)
}

// Stream runs one turn, streamed.
func (s *Session) Stream(ctx context.Context, req Request) (*Stream, error) {
	req.sessionID = s.ID
	return s.c.Stream(ctx, req)
}

// Close frees the session; it returns once its KV blocks are back in the server's pool.
func (s *Session) Close(ctx context.Context) error {
	_, err := s.c.rpc.CloseSession(s.c.outgoing(ctx, s.ID), &kvgenv1.CloseSessionRequest{SessionId: s.ID})
	return wrap(err)
}

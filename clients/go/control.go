package kvgen

import (
	"context"
	"time"

	"kvgen.dev/kvgen/kvgenv1"
)

// AbortResult says which request ids Abort ended.
type AbortResult struct {
	// Aborted named running requests: each has ended with codes.Canceled and freed its KV blocks.
	Aborted []string
	// Unknown named none: finished already, never seen, or another API key's (not an error).
	Unknown []string
}

// Abort ends requests running on the server by their RequestID, whoever sent them with this
// client's API key and on whatever channel. Their calls end with codes.Canceled (errors.Is
// context.Canceled holds), and their KV blocks are back in the pool when Abort returns. Behind a
// mesh, Abort reaches the replica that runs the requests only if it is routed there.
func (c *Client) Abort(ctx context.Context, requestIDs ...string) (*AbortResult, error) {
	r, err := c.rpc.Abort(c.outgoing(ctx, ""), &kvgenv1.AbortRequest{RequestIds: requestIDs})
	if err != nil {
		return nil, wrap(err)
	}
	return &AbortResult{Aborted: r.Aborted, Unknown: r.Unknown}, nil
}

// Load is how busy a server is (what a router or an autoscaler reads).
type Load struct {
	// Replica names the server that answered (its REPLICA_ID; may be empty).
	Replica string
	// Requests in the running batch, and queued for admission.
	Running, Waiting int
	// KV blocks held by requests and sessions, out of the pool's total; KVCacheUsage is their ratio.
	KVBlocksUsed, KVBlocksTotal int
	KVCacheUsage                float64
	SessionsOpen                int
	// PrefixCache is nil when the server runs without a prefix cache (PREFIX_CACHE off).
	PrefixCache *PrefixCacheStats
	// Tokens generated and requests finished per second, over the last Window.
	TokensPerSecond, RequestsPerSecond float64
	Window                             time.Duration
	// Accepting is false while the server loads or drains: send it nothing new.
	Accepting bool
}

// PrefixCacheStats counts the prefix cache's reuse since the server started.
type PrefixCacheStats struct {
	// Requests that reused at least one cached block, and those that found none.
	Hits, Misses int64
	// Prompt tokens reused.
	HitTokens int64
	// Blocks moved out of the pool or dropped.
	Evictions int64
	// Blocks only the cache holds, in the pool and in the warm / cold tiers.
	BlocksInPool, BlocksInTiers int64
}

// Load asks the server how busy it is. A draining server still answers (with Accepting false).
func (c *Client) Load(ctx context.Context) (*Load, error) {
	r, err := c.rpc.GetLoad(c.outgoing(ctx, ""), &kvgenv1.GetLoadRequest{})
	if err != nil {
		return nil, wrap(err)
	}
	l := &Load{
		Replica: r.Replica, Running: int(r.RunningRequests), Waiting: int(r.WaitingRequests),
		KVBlocksUsed: int(r.KvBlocksUsed), KVBlocksTotal: int(r.KvBlocksTotal), KVCacheUsage: r.KvCacheUsage,
		SessionsOpen: int(r.SessionsOpen), TokensPerSecond: r.TokensPerSecond, RequestsPerSecond: r.RequestsPerSecond,
		Window: time.Duration(r.WindowSeconds * float64(time.Second)), Accepting: r.Accepting,
	}
	if p := r.PrefixCache; p != nil {
		l.PrefixCache = &PrefixCacheStats{Hits: p.Hits, Misses: p.Misses, HitTokens: p.HitTokens,
			Evictions: p.Evictions, BlocksInPool: p.BlocksInPool, BlocksInTiers: p.BlocksInTiers}
	}
	return l, nil
}

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

// Adapter is a LoRA adapter the server holds.
type Adapter struct {
	Name string
	// Its highest rank and the modules it adapts (PEFT's names: q_proj, ..., down_proj).
	Rank          int
	TargetModules []string
}

// LoadAdapter loads a LoRA adapter while the server runs, from path on the server's file system (a
// PEFT folder or a llama.cpp GGUF LoRA file); requests may name it once LoadAdapter returns.
// Admin-only where the server sets API keys. InvalidArgument: a bad or foreign adapter;
// AlreadyExists: the name is loaded; ResourceExhausted: the server's MAX_LORAS are loaded.
func (c *Client) LoadAdapter(ctx context.Context, name, path string) (*Adapter, error) {
	r, err := c.rpc.LoadAdapter(c.outgoing(ctx, ""), &kvgenv1.LoadAdapterRequest{Name: name, Path: path})
	if err != nil {
		return nil, wrap(err)
	}
	a := r.GetAdapter()
	return &Adapter{Name: a.GetName(), Rank: int(a.GetRank()), TargetModules: a.GetTargetModules()}, nil
}

// UnloadAdapter unloads an adapter: from the call on, requests naming it get NotFound, and the
// requests already running with it finish first, for up to timeout (0: the server's 30 seconds);
// FailedPrecondition when some still run then (the adapter stays loaded). NotFound when no
// adapter of the name is loaded. Admin-only.
func (c *Client) UnloadAdapter(ctx context.Context, name string, timeout time.Duration) error {
	_, err := c.rpc.UnloadAdapter(c.outgoing(ctx, ""),
		&kvgenv1.UnloadAdapterRequest{Name: name, TimeoutSeconds: timeout.Seconds()})
	return wrap(err)
}

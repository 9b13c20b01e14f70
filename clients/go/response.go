package kvgen

import "kvgen.dev/kvgen/kvgenv1"

// FinishReason says why a generation ended.
type FinishReason = kvgenv1.FinishReason

const (
	StopToken  = kvgenv1.FinishReason_FINISH_REASON_STOP_TOKEN  // EOS, a stop token, or a complete constraint
	StopString = kvgenv1.FinishReason_FINISH_REASON_STOP_STRING // a stop string matched (not returned)
	Length     = kvgenv1.FinishReason_FINISH_REASON_LENGTH      // MaxNewTokens or the context length
	Cancelled  = kvgenv1.FinishReason_FINISH_REASON_CANCELLED
	Aborted    = kvgenv1.FinishReason_FINISH_REASON_ABORTED
)

// Usage counts a request's tokens; CachedTokens of the prompt were reused from a session or the
// prefix cache.
type Usage struct {
	PromptTokens, CompletionTokens, CachedTokens int
}

// TokenLogprob is one generated token's logprob and its top alternatives.
type TokenLogprob struct {
	TokenID int32
	Token   string
	Logprob float32
	Top     []TopLogprob
}

// TopLogprob is one alternative of a token.
type TopLogprob struct {
	TokenID int32
	Token   string
	Logprob float32
}

// Response is a whole generation.
type Response struct {
	RequestID    string
	Text         string
	TokenIDs     []int32
	FinishReason FinishReason
	MatchedStop  string
	Usage        Usage
	Logprobs     []TokenLogprob
}

// Delta is one message of a stream: new text and tokens; the last one has FinishReason and Usage.
type Delta struct {
	Text         string
	TokenIDs     []int32
	Logprobs     []TokenLogprob
	FinishReason FinishReason // 0 until the last delta
	MatchedStop  string
	Usage        *Usage // on the last delta only
}

func responseOf(r *kvgenv1.GenerateResponse) *Response {
	return &Response{RequestID: r.RequestId, Text: r.Text, TokenIDs: r.TokenIds, FinishReason: r.FinishReason,
		MatchedStop: r.MatchedStop, Usage: usageOf(r.Usage), Logprobs: logprobsOf(r.Logprobs)}
}

func deltaOf(m *kvgenv1.GenerateStreamResponse) Delta {
	d := Delta{Text: m.Text, TokenIDs: m.TokenIds, Logprobs: logprobsOf(m.Logprobs), FinishReason: m.FinishReason,
		MatchedStop: m.MatchedStop}
	if m.Usage != nil {
		u := usageOf(m.Usage)
		d.Usage = &u
	}
	return d
}

func usageOf(u *kvgenv1.Usage) Usage {
	if u == nil {
		return Usage{}
	}
	return Usage{int(u.PromptTokens), int(u.CompletionTokens), int(u.CachedTokens)}
}

func logprobsOf(items []*kvgenv1.TokenLogprob) []TokenLogprob {
	var out []TokenLogprob
	for _, t := range items {
		lp := TokenLogprob{TokenID: t.TokenId, Token: t.Token, Logprob: t.Logprob}
		for _, a := range t.Top {
			lp.Top = append(lp.Top, TopLogprob{a.TokenId, a.Token, a.Logprob})
		}
		out = append(out, lp)
	}
	return out
}

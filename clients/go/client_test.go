package kvgen_test

// These tests run against a real server: KVGEN_TARGET=host:port (the repository's `make test`
// starts one on a tiny random model; its text means nothing, its tokens and errors do).

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"kvgen.dev/kvgen"
)

func dial(t *testing.T) *kvgen.Client {
	t.Helper()
	target := os.Getenv("KVGEN_TARGET")
	if target == "" {
		t.Skip("KVGEN_TARGET is not set")
	}
	c, err := kvgen.Dial(target, kvgen.WithAPIKey(os.Getenv("KVGEN_API_KEY")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return c
}

func greedy(n int32) kvgen.Sampling {
	return kvgen.Sampling{Temperature: kvgen.Ptr[float32](0), MaxNewTokens: kvgen.Ptr(n), IgnoreEOS: true}
}

func TestGenerate(t *testing.T) {
	c := dial(t)
	r, err := c.Generate(ctx(t), kvgen.Request{Prompt: "Once upon a time", Sampling: greedy(8)})
	if err != nil {
		t.Fatal(err)
	}
	if r.Usage.CompletionTokens != 8 || len(r.TokenIDs) != 8 || r.FinishReason != kvgen.Length || r.RequestID == "" {
		t.Fatalf("unexpected response %+v", r)
	}
}

func TestStreamAddsUpToGenerate(t *testing.T) {
	c := dial(t)
	req := kvgen.Request{Messages: []kvgen.Message{{Role: "user", Content: "Hi!"}}, Sampling: greedy(12)}
	whole, err := c.Generate(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.Stream(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	deltas, text := 0, ""
	var last kvgen.Delta
	for s.Next() {
		deltas++
		last = s.Delta()
		text += last.Text
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	if text != whole.Text || deltas < 2 || last.FinishReason != kvgen.Length || last.Usage == nil ||
		last.Usage.CompletionTokens != 12 {
		t.Fatalf("stream %q in %d deltas (last %+v); whole %q", text, deltas, last, whole.Text)
	}
}

func TestCancellingTheContextStopsTheStream(t *testing.T) {
	c := dial(t)
	cctx, cancel := context.WithCancel(ctx(t))
	s, err := c.Stream(cctx, kvgen.Request{Prompt: "Once upon a time", Sampling: greedy(1900)})
	if err != nil {
		t.Fatal(err)
	}
	if !s.Next() {
		t.Fatal(s.Err())
	}
	cancel()
	for s.Next() {
	}
	var e *kvgen.Error
	if !errors.Is(s.Err(), context.Canceled) || !errors.As(s.Err(), &e) || e.Code != codes.Canceled {
		t.Fatalf("want a cancelled stream, got %v", s.Err())
	}
}

func TestCloseStopsTheStream(t *testing.T) {
	c := dial(t)
	s, err := c.Stream(ctx(t), kvgen.Request{Prompt: "Once upon a time", Sampling: greedy(1900)})
	if err != nil {
		t.Fatal(err)
	}
	if !s.Next() {
		t.Fatal(s.Err())
	}
	s.Close()
	if s.Next() {
		t.Fatal("a closed stream went on")
	}
}

func TestDeadlineIsDeadlineExceeded(t *testing.T) {
	c := dial(t)
	dctx, cancel := context.WithTimeout(ctx(t), 300*time.Millisecond)
	defer cancel()
	_, err := c.Generate(dctx, kvgen.Request{Prompt: "Once upon a time", Sampling: greedy(1900)})
	var e *kvgen.Error
	if !errors.Is(err, context.DeadlineExceeded) || !errors.As(err, &e) || e.Code != codes.DeadlineExceeded {
		t.Fatalf("want DeadlineExceeded, got %v", err)
	}
}

func TestSessionReusesItsConversation(t *testing.T) {
	c := dial(t)
	s, err := c.CreateSession(ctx(t), "")
	if err != nil {
		t.Fatal(err)
	}
	if len(s.ID) != 32 {
		t.Fatalf("session id %q", s.ID)
	}
	turn := func(text string) *kvgen.Response {
		r, err := s.Generate(ctx(t), kvgen.Request{Messages: []kvgen.Message{{Role: "user", Content: text}},
			Sampling: greedy(6)})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	turn("The first question of a long conversation, with enough words to fill a few KV blocks.")
	second := turn("And a second one.")
	if second.Usage.CachedTokens == 0 || second.Usage.CachedTokens >= second.Usage.PromptTokens {
		t.Fatalf("the second turn reused %d of %d prompt tokens", second.Usage.CachedTokens, second.Usage.PromptTokens)
	}
	st, err := s.Stream(ctx(t), kvgen.Request{Prompt: " and then", Sampling: greedy(3)})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := st.Collect(); err != nil || r.Usage.CompletionTokens != 3 {
		t.Fatalf("streamed turn: %+v, %v", r, err)
	}
	if err := s.Close(ctx(t)); err != nil {
		t.Fatal(err)
	}
	_, err = s.Generate(ctx(t), kvgen.Request{Prompt: "again", Sampling: greedy(2)})
	var e *kvgen.Error
	if !errors.As(err, &e) || e.Code != codes.NotFound {
		t.Fatalf("a closed session: want NotFound, got %v", err)
	}
}

func TestInvalidArgumentNamesTheFields(t *testing.T) {
	c := dial(t)
	_, err := c.Generate(ctx(t), kvgen.Request{Prompt: "hi", Sampling: kvgen.Sampling{
		Temperature: kvgen.Ptr[float32](-1), TopP: kvgen.Ptr[float32](2)}})
	var e *kvgen.Error
	if !errors.As(err, &e) || e.Code != codes.InvalidArgument {
		t.Fatalf("want InvalidArgument, got %v", err)
	}
	fields := map[string]bool{}
	for _, v := range e.Violations {
		fields[v.Field] = v.Description != ""
	}
	if !fields["sampling.temperature"] || !fields["sampling.top_p"] || e.Retryable() {
		t.Fatalf("violations %+v", e.Violations)
	}
}

func TestBatchFailsOneEntryAlone(t *testing.T) {
	c := dial(t)
	results, err := c.Batch(ctx(t), []kvgen.Request{
		{Prompt: "one", Sampling: greedy(3)},
		{Prompt: "two", Sampling: kvgen.Sampling{MaxNewTokens: kvgen.Ptr[int32](0)}},
		{TokenIDs: []int32{5, 6, 7}, Sampling: greedy(2)},
	})
	if err != nil {
		t.Fatal(err)
	}
	var e *kvgen.Error
	if results[0].Err != nil || results[0].Response.Usage.CompletionTokens != 3 ||
		!errors.As(results[1].Err, &e) || e.Code != codes.InvalidArgument || e.Violations[0].Field != "sampling.max_new_tokens" ||
		results[2].Err != nil || len(results[2].Response.TokenIDs) != 2 {
		t.Fatalf("batch results %+v", results)
	}
}

func TestBatchStreamTagsEachDeltaAndFailsOneEntryAlone(t *testing.T) {
	c := dial(t)
	reqs := []kvgen.Request{
		{Prompt: "one", Sampling: greedy(5)},
		{Prompt: "two", Sampling: kvgen.Sampling{MaxNewTokens: kvgen.Ptr[int32](0)}},
		{TokenIDs: []int32{5, 6, 7}, Sampling: greedy(4)},
	}
	s, err := c.BatchStream(ctx(t), reqs)
	if err != nil {
		t.Fatal(err)
	}
	tokens := map[int][]int32{}
	var entryErr error
	for s.Next() {
		d := s.Delta()
		if d.Err != nil {
			if d.Index != 1 || entryErr != nil {
				t.Fatalf("entry %d failed: %v", d.Index, d.Err)
			}
			entryErr = d.Err
			continue
		}
		tokens[d.Index] = append(tokens[d.Index], d.Delta.TokenIDs...)
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	var e *kvgen.Error
	if !errors.As(entryErr, &e) || e.Code != codes.InvalidArgument || e.Violations[0].Field != "sampling.max_new_tokens" {
		t.Fatalf("entry 1: want InvalidArgument on sampling.max_new_tokens, got %v", entryErr)
	}
	for _, i := range []int{0, 2} {
		alone, err := c.Generate(ctx(t), reqs[i])
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(tokens[i]) != fmt.Sprint(alone.TokenIDs) {
			t.Fatalf("entry %d streamed %v; alone %v", i, tokens[i], alone.TokenIDs)
		}
	}
	s, err = c.BatchStream(ctx(t), reqs)
	if err != nil {
		t.Fatal(err)
	}
	results, err := s.Collect()
	if err != nil || len(results) != 3 || results[0].Response.Usage.CompletionTokens != 5 ||
		!errors.As(results[1].Err, &e) || len(results[2].Response.TokenIDs) != 4 ||
		results[2].Response.FinishReason != kvgen.Length {
		t.Fatalf("collected %+v, %v", results, err)
	}
}

func TestClosingABatchStreamStopsEveryEntry(t *testing.T) {
	c := dial(t)
	s, err := c.BatchStream(ctx(t), []kvgen.Request{
		{Prompt: "a long story", Sampling: greedy(1900)}, {Prompt: "another one", Sampling: greedy(1900)}})
	if err != nil {
		t.Fatal(err)
	}
	if !s.Next() || s.Delta().Err != nil {
		t.Fatal(s.Err(), s.Delta().Err)
	}
	s.Close()
	if s.Next() {
		t.Fatal("a closed batch stream went on")
	}
	load, err := c.Load(ctx(t))
	for i := 0; err == nil && (load.Running > 0 || load.KVBlocksUsed > 0) && i < 200; i++ {
		time.Sleep(50 * time.Millisecond)
		load, err = c.Load(ctx(t))
	}
	if err != nil || load.Running != 0 || load.KVBlocksUsed != 0 {
		t.Fatalf("the server still runs %+v, %v", load, err)
	}
}

func TestModelInfo(t *testing.T) {
	c := dial(t)
	info, err := c.ModelInfo(ctx(t))
	if err != nil || info.Name == "" || info.ContextLength <= 0 {
		t.Fatalf("model info %v, %v", info, err)
	}
}

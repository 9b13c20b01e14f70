package kvgen_test

import (
	"errors"
	"os"
	"reflect"
	"testing"

	"google.golang.org/grpc/codes"

	"kvgen.dev/kvgen"
)

// adapter is the LoRA adapter the test server loaded (KVGEN_ADAPTER=name, KVGEN_ADAPTER_PATH=its
// folder on the server's disk): random weights, large enough to change greedy tokens.
func adapter(t *testing.T) (name, path string) {
	name, path = os.Getenv("KVGEN_ADAPTER"), os.Getenv("KVGEN_ADAPTER_PATH")
	if name == "" || path == "" {
		t.Skip("KVGEN_ADAPTER and KVGEN_ADAPTER_PATH are not set")
	}
	return name, path
}

func sameTokens(a, b []int32) bool { return reflect.DeepEqual(a, b) }

func isCode(err error, code codes.Code) bool {
	var e *kvgen.Error
	return errors.As(err, &e) && e.Code == code
}

func TestAdapterChangesTheTokensEverywhere(t *testing.T) {
	c := dial(t)
	name, _ := adapter(t)
	req := kvgen.Request{Prompt: "Once upon a time", Sampling: greedy(8)}
	base, err := c.Generate(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	req.Adapter = name
	tuned, err := c.Generate(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	if sameTokens(base.TokenIDs, tuned.TokenIDs) {
		t.Fatalf("the adapter changed nothing: %v", base.TokenIDs)
	}
	s, err := c.Stream(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	streamed, err := s.Collect()
	if err != nil {
		t.Fatal(err)
	}
	if !sameTokens(streamed.TokenIDs, tuned.TokenIDs) {
		t.Fatalf("stream %v, generate %v", streamed.TokenIDs, tuned.TokenIDs)
	}
	plain := req
	plain.Adapter = ""
	batch, err := c.Batch(ctx(t), []kvgen.Request{plain, req})
	if err != nil {
		t.Fatal(err)
	}
	if batch[0].Err != nil || batch[1].Err != nil || !sameTokens(batch[0].Response.TokenIDs, base.TokenIDs) ||
		!sameTokens(batch[1].Response.TokenIDs, tuned.TokenIDs) {
		t.Fatalf("batch entries do not follow their adapters: %+v", batch)
	}
	sess, err := c.CreateSession(ctx(t), "", kvgen.SessionAdapter(name))
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close(ctx(t))
	turn, err := sess.Generate(ctx(t), plain) // the session's adapter, though the turn names none
	if err != nil {
		t.Fatal(err)
	}
	if !sameTokens(turn.TokenIDs, tuned.TokenIDs) {
		t.Fatalf("session turn %v, adapter %v", turn.TokenIDs, tuned.TokenIDs)
	}
}

func TestUnknownAdapterIsNotFound(t *testing.T) {
	c := dial(t)
	adapter(t)
	_, err := c.Generate(ctx(t), kvgen.Request{Prompt: "hi", Sampling: greedy(2), Adapter: "no-such-adapter"})
	if !isCode(err, codes.NotFound) {
		t.Fatalf("want NotFound, got %v", err)
	}
	if _, err := c.CreateSession(ctx(t), "", kvgen.SessionAdapter("no-such-adapter")); !isCode(err, codes.NotFound) {
		t.Fatalf("want NotFound, got %v", err)
	}
	if err := c.UnloadAdapter(ctx(t), "no-such-adapter", 0); !isCode(err, codes.NotFound) {
		t.Fatalf("want NotFound, got %v", err)
	}
}

func TestUnloadThenLoadAdapter(t *testing.T) {
	c := dial(t)
	name, path := adapter(t)
	req := kvgen.Request{Prompt: "Once upon a time", Sampling: greedy(8), Adapter: name}
	before, err := c.Generate(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.UnloadAdapter(ctx(t), name, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Generate(ctx(t), req); !isCode(err, codes.NotFound) {
		t.Fatalf("unloaded: want NotFound, got %v", err)
	}
	a, err := c.LoadAdapter(ctx(t), name, path)
	if err != nil {
		t.Fatal(err) // the adapter stays unloaded: the tests after this one see NotFound
	}
	if a.Name != name || a.Rank <= 0 || len(a.TargetModules) == 0 {
		t.Fatalf("unexpected adapter %+v", a)
	}
	if _, err := c.LoadAdapter(ctx(t), name, path); !isCode(err, codes.AlreadyExists) {
		t.Fatalf("loaded twice: want AlreadyExists, got %v", err)
	}
	after, err := c.Generate(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	if !sameTokens(before.TokenIDs, after.TokenIDs) {
		t.Fatalf("reloaded adapter gives %v, was %v", after.TokenIDs, before.TokenIDs)
	}
}

package kvgen_test

import (
	"errors"
	"testing"

	"google.golang.org/grpc/codes"

	"kvgen.dev/kvgen"
)

// violates reports whether err is InvalidArgument naming field among its violations.
func violates(err error, field string) bool {
	var e *kvgen.Error
	if !errors.As(err, &e) || e.Code != codes.InvalidArgument {
		return false
	}
	for _, v := range e.Violations {
		if v.Field == field {
			return true
		}
	}
	return false
}

func TestKVCompressTravelsPerRequestAndPerSession(t *testing.T) {
	c := dial(t)
	req := kvgen.Request{Prompt: "Once upon a time", Sampling: greedy(4), KVCompress: "mean"}
	if _, err := c.Generate(ctx(t), req); err != nil {
		t.Fatal(err)
	}
	req.KVCompress = "zip"
	if _, err := c.Generate(ctx(t), req); !violates(err, "kv_compress") {
		t.Fatalf("an unknown method: %v", err)
	}
	s, err := c.CreateSession(ctx(t), "", kvgen.SessionKVCompress("sink-heavy"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx(t))
	if _, err := s.Generate(ctx(t), kvgen.Request{Prompt: "Hello", Sampling: greedy(4)}); err != nil {
		t.Fatal(err)
	}
	turn := kvgen.Request{Prompt: " again", Sampling: greedy(4), KVCompress: "mean"}
	if _, err := s.Generate(ctx(t), turn); !violates(err, "kv_compress") {
		t.Fatalf("a turn naming another compression than its session's: %v", err)
	}
	if _, err := c.CreateSession(ctx(t), "", kvgen.SessionKVCompress("zip")); !violates(err, "kv_compress") {
		t.Fatalf("a session with an unknown method: %v", err)
	}
}

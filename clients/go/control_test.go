package kvgen_test

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"kvgen.dev/kvgen"
)

func randomID(t *testing.T) string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return "go-" + hex.EncodeToString(b[:])
}

func TestAbortEndsARunningStream(t *testing.T) {
	c := dial(t)
	id := randomID(t)
	s, err := c.Stream(ctx(t), kvgen.Request{Prompt: "Once upon a time", Sampling: greedy(1900), RequestID: id})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !s.Next() {
		t.Fatal(s.Err())
	}
	res, err := c.Abort(ctx(t), id, "no-such-request")
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Aborted) != 1 || res.Aborted[0] != id || len(res.Unknown) != 1 || res.Unknown[0] != "no-such-request" {
		t.Fatalf("abort result %+v", res)
	}
	for s.Next() {
	}
	var e *kvgen.Error
	if !errors.As(s.Err(), &e) || e.Code != codes.Canceled {
		t.Fatalf("an aborted stream: want Canceled, got %v", s.Err())
	}
	// the request is over: aborting it again finds nothing
	if again, err := c.Abort(ctx(t), id); err != nil || len(again.Aborted) != 0 || len(again.Unknown) != 1 {
		t.Fatalf("second abort: %+v, %v", again, err)
	}
}

func TestLoadSeesARunningRequest(t *testing.T) {
	c := dial(t)
	s, err := c.Stream(ctx(t), kvgen.Request{Prompt: "Once upon a time", Sampling: greedy(1900)})
	if err != nil {
		t.Fatal(err)
	}
	if !s.Next() {
		t.Fatal(s.Err())
	}
	busy, err := c.Load(ctx(t))
	s.Close()
	if err != nil {
		t.Fatal(err)
	}
	if !busy.Accepting || busy.Running < 1 || busy.KVBlocksUsed < 1 || busy.KVBlocksTotal < busy.KVBlocksUsed ||
		busy.KVCacheUsage <= 0 || busy.KVCacheUsage > 1 || busy.Window <= 0 {
		t.Fatalf("load while a request runs: %+v", busy)
	}
	info, err := c.ModelInfo(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if info.PrefixCache != (busy.PrefixCache != nil) {
		t.Fatalf("prefix cache %v, but its stats are %+v", info.PrefixCache, busy.PrefixCache)
	}
	// the closed stream gives its blocks back
	deadline := time.Now().Add(10 * time.Second)
	for {
		idle, err := c.Load(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		if idle.Running == 0 && idle.KVBlocksUsed == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("load after the stream closed: %+v", idle)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

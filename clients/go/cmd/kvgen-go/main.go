// kvgen-go streams text from a kvgen server.
//
//	kvgen-go -chat "What is the capital of France?" -temperature 0
//	kvgen-go -max-new-tokens 64 -seed 7 "Once upon a time"
//
// KVGEN_TARGET and KVGEN_API_KEY give -target and -api-key their defaults.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"

	"kvgen.dev/kvgen"
)

type stops []string

func (s *stops) String() string     { return strings.Join(*s, ",") }
func (s *stops) Set(v string) error { *s = append(*s, v); return nil }

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	fs := flag.NewFlagSet("kvgen-go", flag.ContinueOnError)
	target := fs.String("target", env("KVGEN_TARGET", "localhost:50051"), "server host:port")
	apiKey := fs.String("api-key", os.Getenv("KVGEN_API_KEY"), "API key (the server's API_KEY)")
	chat := fs.Bool("chat", false, "send the prompt as a user chat message")
	system := fs.String("system", "", "system message (with -chat)")
	maxNew := fs.Int("max-new-tokens", -1, "most tokens to generate (unset: the server's default)")
	temperature := fs.Float64("temperature", -1, "0 is greedy (unset: the server's default)")
	seed := fs.Int64("seed", -1, "sampling seed (unset: random)")
	var stop stops
	fs.Var(&stop, "stop", "stop string (repeatable)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: kvgen-go [flags] PROMPT")
		fs.PrintDefaults()
		return 2
	}
	req := kvgen.Request{Prompt: fs.Arg(0)}
	if *chat {
		req.Prompt = ""
		if *system != "" {
			req.Messages = append(req.Messages, kvgen.Message{Role: "system", Content: *system})
		}
		req.Messages = append(req.Messages, kvgen.Message{Role: "user", Content: fs.Arg(0)})
	}
	if *maxNew >= 0 {
		req.Sampling.MaxNewTokens = kvgen.Ptr(int32(*maxNew))
	}
	if *temperature >= 0 {
		req.Sampling.Temperature = kvgen.Ptr(float32(*temperature))
	}
	if *seed >= 0 {
		req.Sampling.Seed = kvgen.Ptr(uint64(*seed))
	}
	req.Sampling.StopStrings = stop

	ctx, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt) // Ctrl-C cancels the generation
	defer stopSignals()
	c, err := kvgen.Dial(*target, kvgen.WithAPIKey(*apiKey))
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	s, err := c.Stream(ctx, req)
	if err != nil {
		return fail(err)
	}
	var last kvgen.Delta
	for s.Next() {
		last = s.Delta()
		fmt.Print(last.Text)
	}
	fmt.Println()
	if err := s.Err(); err != nil {
		return fail(err)
	}
	if u := last.Usage; u != nil {
		fmt.Fprintf(os.Stderr, "[%s; prompt %d, completion %d, cached %d tokens]\n", last.FinishReason,
			u.PromptTokens, u.CompletionTokens, u.CachedTokens)
	}
	return 0
}

func fail(err error) int {
	var e *kvgen.Error
	if errors.As(err, &e) {
		fmt.Fprintf(os.Stderr, "error: %s: %s\n", e.Code, e.Message)
		for _, v := range e.Violations {
			fmt.Fprintf(os.Stderr, "  %s: %s\n", v.Field, v.Description)
		}
		return 1
	}
	fmt.Fprintln(os.Stderr, "error:", err)
	return 1
}

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

package kvgen

import "kvgen.dev/kvgen/kvgenv1"

// Message is one chat turn; Role is "system", "user" or "assistant".
type Message struct {
	Role    string
	Content string
}

// Request is one generation: exactly one of Prompt, Messages (rendered with the model's chat
// template) and TokenIDs.
type Request struct {
	Prompt    string
	Messages  []Message
	TokenIDs  []int32
	Sampling  Sampling
	RequestID string // echoed back; the server makes one when empty
	CacheSalt string // requests share prefix-cache blocks only with requests of the same salt
	// KVCompress is the request's KV compression: "off", "mean" or "sink-heavy" ("": the server's
	// KV_COMPRESS); lossy, and refused (InvalidArgument) where the server cannot compress.
	KVCompress string
	// Adapter is the LoRA adapter to run with, by name (the server's LORA_ADAPTERS or LoadAdapter;
	// "": the base model); one not loaded is NotFound. In a session, the session's adapter.
	Adapter   string
	sessionID string // set by Session
}

// Sampling holds the sampling parameters; nil pointers take the server's defaults (Ptr makes
// one: Temperature: kvgen.Ptr[float32](0) is greedy).
type Sampling struct {
	Temperature       *float32
	TopK              *int32
	TopP              *float32
	MinP              *float32
	RepetitionPenalty *float32
	PresencePenalty   *float32
	FrequencyPenalty  *float32
	MaxNewTokens      *int32
	MinNewTokens      *int32
	StopTokenIDs      []int32
	StopStrings       []string
	Seed              *uint64
	Logprobs          *int32 // top alternatives returned per token
	IgnoreEOS         bool
	LogitBias         map[int32]float32
	// At most one constraint on the output.
	JSONSchema string
	JSONObject bool
	Regex      string
	Choices    []string
}

// Ptr returns a pointer to v, for the optional fields of Sampling.
func Ptr[T any](v T) *T { return &v }

func (r Request) proto() *kvgenv1.GenerateRequest {
	s := r.Sampling
	sp := &kvgenv1.SamplingParams{
		Temperature: s.Temperature, TopK: s.TopK, TopP: s.TopP, MinP: s.MinP,
		RepetitionPenalty: s.RepetitionPenalty, PresencePenalty: s.PresencePenalty,
		FrequencyPenalty: s.FrequencyPenalty, MaxNewTokens: s.MaxNewTokens, MinNewTokens: s.MinNewTokens,
		StopTokenIds: s.StopTokenIDs, StopStrings: s.StopStrings, Seed: s.Seed, Logprobs: s.Logprobs,
		IgnoreEos: s.IgnoreEOS, LogitBias: s.LogitBias,
	}
	switch {
	case s.JSONSchema != "":
		sp.Constraint = &kvgenv1.SamplingParams_JsonSchema{JsonSchema: s.JSONSchema}
	case s.JSONObject:
		sp.Constraint = &kvgenv1.SamplingParams_JsonObject{JsonObject: true}
	case s.Regex != "":
		sp.Constraint = &kvgenv1.SamplingParams_Regex{Regex: s.Regex}
	case len(s.Choices) > 0:
		sp.Constraint = &kvgenv1.SamplingParams_Choice{Choice: &kvgenv1.ChoiceList{Choices: s.Choices}}
	}
	msg := &kvgenv1.GenerateRequest{Prompt: r.Prompt, PromptTokenIds: r.TokenIDs, Sampling: sp,
		RequestId: r.RequestID, SessionId: r.sessionID, CacheSalt: r.CacheSalt}
	msg.KvCompress = r.KVCompress
	msg.Adapter = r.Adapter
	for _, m := range r.Messages {
		msg.Messages = append(msg.Messages, &kvgenv1.ChatMessage{Role: m.Role, Content: m.Content})
	}
	return msg
}

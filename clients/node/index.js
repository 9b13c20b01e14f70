'use strict';
/**
 * Node.js client for kvgen.v1.Generator.
 *
 * The service definition is loaded at run time from the repository's
 * protos/kvgen/v1/generate.proto (no generated code); google/rpc/*.proto come
 * from the google-proto-files package.
 *
 * Field naming: proto-loader runs with keepCase: false, so every message field
 * is lowerCamelCase in JavaScript (max_new_tokens -> maxNewTokens,
 * prompt_token_ids -> promptTokenIds, finish_reason -> finishReason). Enums are
 * strings ('FINISH_REASON_LENGTH'), 64-bit integers are decimal strings, and
 * unset scalar fields of responses are filled with their defaults. Sampling
 * parameters may be given in either spelling (max_new_tokens or maxNewTokens).
 */

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const DEFAULT_PROTO_DIR = path.resolve(__dirname, '..', '..', 'protos');
const GOOGLE_PROTO_DIR = path.dirname(require.resolve('google-proto-files/package.json'));
const PROTO_FILES = ['kvgen/v1/generate.proto', 'google/rpc/status.proto', 'google/rpc/error_details.proto'];

/** The metadata a mesh routes a session's calls by (the session id; see README "Deployment"). */
const SESSION_HEADER = 'x-session-id';

/** Options shared by proto-loader (calls) and protobufjs (error details), so both give the same shapes. */
const OBJECT_OPTIONS = { longs: String, enums: String, defaults: true, oneofs: true };

const loaded = new Map(); // proto dir -> {Generator, root}

/** The service and a protobufjs root; with no dir, the first one loaded (else $KVGEN_PROTO_DIR or ../../protos). */
function load(protoDir) {
  if (!protoDir) {
    if (loaded.size) return loaded.values().next().value;
    protoDir = process.env.KVGEN_PROTO_DIR || DEFAULT_PROTO_DIR;
  }
  let l = loaded.get(protoDir);
  if (l) return l;
  const includeDirs = [protoDir, GOOGLE_PROTO_DIR];
  const packageDefinition = protoLoader.loadSync(PROTO_FILES, { keepCase: false, includeDirs, ...OBJECT_OPTIONS });
  const Generator = grpc.loadPackageDefinition(packageDefinition).kvgen.v1.Generator;

  // A protobufjs root over the same files, to decode google.rpc.Status and its details.
  const root = new protobuf.Root();
  root.resolvePath = (origin, target) => {
    for (const dir of includeDirs) {
      const p = path.join(dir, target);
      if (fs.existsSync(p)) return p;
    }
    return protobuf.util.path.resolve(origin, target);
  };
  root.loadSync(PROTO_FILES, { keepCase: false });
  root.resolveAll();
  l = { Generator, root };
  loaded.set(protoDir, l);
  return l;
}

// ---------------------------------------------------------------------------
// Requests

const camel = (k) => k.replace(/_([a-z0-9])/g, (_, c) => c.toUpperCase());

// Conveniences for the constraint fields: a schema may be an object, choices a plain array.
function samplingValue(k, value) {
  if (k === 'jsonSchema' && typeof value === 'object') return JSON.stringify(value);
  if (k === 'choice' && Array.isArray(value)) return { choices: value.map(String) };
  return value;
}

/**
 * A GenerateRequest from input and sampling parameters.
 * @param {string | Array<{role: string, content: string}> | number[]} input
 *   a prompt, chat messages, or prompt token ids.
 * @param {object} [sampling] SamplingParams fields, snake_case or camelCase; one constraint at most:
 *   jsonSchema (a string or an object), regex, grammar (Lark), choice (an array of strings) or
 *   jsonObject: true; logitBias is an object of token id -> bias.
 * @param {{sessionId?: string, requestId?: string, adapter?: string}} [opts] adapter: a LoRA adapter's
 *   name (the server's LORA_ADAPTERS or loadAdapter); unset: the base model.
 */
function buildRequest(input, sampling = {}, opts = {}) {
  const req = {};
  if (typeof input === 'string') {
    req.prompt = input;
  } else if (Array.isArray(input)) {
    if (input.length && input.every((x) => typeof x === 'number' || typeof x === 'bigint')) {
      req.promptTokenIds = input.map(Number);
    } else if (input.every((m) => m && typeof m === 'object' && typeof m.content === 'string')) {
      req.messages = input.map((m) => ({ role: String(m.role ?? 'user'), content: m.content }));
    } else {
      throw new TypeError('input array must hold only token ids (numbers) or only {role, content} messages');
    }
  } else {
    throw new TypeError('input must be a string, an array of {role, content} messages or an array of token ids');
  }
  const fields = load().root.lookupType('kvgen.v1.SamplingParams').fields;
  const s = {};
  for (const [key, value] of Object.entries(sampling || {})) {
    if (value === undefined || value === null) continue;
    const k = camel(key);
    if (!(k in fields)) throw new TypeError(`unknown sampling parameter ${JSON.stringify(key)}`);
    s[k] = samplingValue(k, value);
  }
  req.sampling = s;
  if (opts.sessionId) req.sessionId = opts.sessionId;
  if (opts.requestId) req.requestId = opts.requestId;
  if (opts.adapter) req.adapter = opts.adapter;
  return req;
}

// ---------------------------------------------------------------------------
// Error details

function typeName(any) {
  const url = any.typeUrl ?? any.type_url ?? '';
  return url.slice(url.lastIndexOf('/') + 1);
}

/**
 * The google.rpc.Status carried by an error: decoded from the
 * `grpc-status-details-bin` trailer of a grpc-js ServiceError, or the error
 * itself when it already is a Status (a BatchGenerate entry's `error`).
 * @returns {{code: number, message: string, details: Array<{typeUrl: string, value: Buffer}>} | null}
 */
function rpcStatus(err) {
  if (!err) return null;
  if (err.metadata && typeof err.metadata.get === 'function') {
    const [bin] = err.metadata.get('grpc-status-details-bin');
    if (!bin) return null;
    const Status = load().root.lookupType('google.rpc.Status');
    return Status.toObject(Status.decode(bin), OBJECT_OPTIONS);
  }
  if (Array.isArray(err.details)) return err; // already a google.rpc.Status object
  return null;
}

/**
 * Every detail of an error's google.rpc.Status whose type is known (google.rpc.*),
 * decoded, each with its full type name under `@type`.
 * @returns {Array<object>}
 */
function errorDetails(err) {
  const status = rpcStatus(err);
  if (!status) return [];
  const { root } = load();
  const out = [];
  for (const any of status.details || []) {
    const name = typeName(any);
    const Type = lookupType(root, name);
    if (!Type) continue;
    out.push({ '@type': name, ...Type.toObject(Type.decode(any.value), OBJECT_OPTIONS) });
  }
  return out;
}

/** A message type by full name, or null when the root does not know it. */
function lookupType(root, name) {
  const t = root.lookup(name);
  return t instanceof protobuf.Type ? t : null;
}

/**
 * The field violations of an INVALID_ARGUMENT error (google.rpc.BadRequest in
 * the status details), as [{field, description}]; [] when there are none.
 * Accepts a grpc-js ServiceError or a google.rpc.Status (a BatchGenerate entry's error).
 */
function badRequestFields(err) {
  return errorDetails(err)
    .filter((d) => d['@type'] === 'google.rpc.BadRequest')
    .flatMap((d) => d.fieldViolations.map((v) => ({ field: v.field, description: v.description })));
}

/** The google.rpc.RetryInfo delay of a RESOURCE_EXHAUSTED error, in milliseconds; null when absent. */
function retryDelayMs(err) {
  const info = errorDetails(err).find((d) => d['@type'] === 'google.rpc.RetryInfo');
  if (!info || !info.retryDelay) return null;
  return Number(info.retryDelay.seconds) * 1000 + info.retryDelay.nanos / 1e6;
}

// ---------------------------------------------------------------------------
// Streams

/**
 * A running GenerateStream call: an async iterator (and iterable) of
 * GenerateStreamResponse messages. `cancel()` stops it; iteration then ends
 * without an error. Leaving a `for await` loop early cancels the call too.
 * Server errors (and DEADLINE_EXCEEDED) reject `next()` with the ServiceError.
 */
class GenerateStream {
  constructor(call) {
    /** The underlying grpc-js ClientReadableStream (for 'metadata' / 'status' events). */
    this.call = call;
    this.cancelled = false;
    this._done = false;
    this._it = this._iterate();
  }

  async *_iterate() {
    try {
      for await (const msg of this.call) yield msg;
    } catch (err) {
      if (!(this.cancelled && err && err.code === grpc.status.CANCELLED)) throw err;
    } finally {
      this._done = true;
    }
  }

  /** Cancels the call; the server stops generating and frees the request's cache. */
  cancel() {
    if (this._done) return;
    this.cancelled = true;
    this.call.cancel();
  }

  next() {
    return this._it.next();
  }

  return(value) {
    this.cancel();
    return this._it.return(value);
  }

  throw(err) {
    this.cancel();
    return this._it.throw(err);
  }

  [Symbol.asyncIterator]() {
    return this;
  }

  /** Reads the stream to its end: {text, tokenIds, messages, last} (last carries finishReason and usage). */
  async collect() {
    const messages = [];
    for await (const m of this) messages.push(m);
    return summarize(messages);
  }
}

/** One request's stream messages as {text, tokenIds, messages, last}. */
function summarize(messages) {
  return {
    text: messages.map((m) => m.text).join(''),
    tokenIds: messages.flatMap((m) => m.tokenIds),
    messages,
    last: messages[messages.length - 1] ?? null,
  };
}

/**
 * A running BatchGenerateStream call: an async iterator of BatchGenerateStreamResponse messages,
 * `{index, result: 'response', response}` (a GenerateStreamResponse of entry `index`) or
 * `{index, result: 'error', error}` (the google.rpc.Status that ended that entry; the others go
 * on). Each entry's messages come in order, the entries' interleaved; cancel() as GenerateStream's.
 */
class BatchGenerateStream extends GenerateStream {
  constructor(call, entries) {
    super(call);
    this.entries = entries;
  }

  /**
   * Reads the stream to its end: per entry, in order, what GenerateStream.collect() gives (sample
   * 0's, for an entry with n > 1), or {error} for an entry that failed.
   */
  async collect() {
    const messages = Array.from({ length: this.entries }, () => []);
    const errors = new Map();
    for await (const m of this) {
      if (m.result === 'error') errors.set(m.index, m.error);
      else if (m.response.index === 0) messages[m.index]?.push(m.response);
    }
    return messages.map((ms, i) => (errors.has(i) ? { error: errors.get(i) } : summarize(ms)));
  }
}

/** Cancels `stream` when `signal` aborts (at once if it already has). */
function cancelOnAbort(stream, signal) {
  if (!signal) return stream;
  if (signal.aborted) stream.cancel();
  else signal.addEventListener('abort', () => stream.cancel(), { once: true });
  return stream;
}

// ---------------------------------------------------------------------------
// Client

class KvgenClient {
  /**
   * @param {string} [target] host:port; default $KVGEN_TARGET or localhost:50051.
   * @param {object} [options]
   * @param {string} [options.apiKey] sent as `authorization: Bearer <key>`; default $KVGEN_API_KEY.
   * @param {grpc.ChannelCredentials} [options.credentials] default insecure.
   * @param {object} [options.channelOptions] grpc-js channel options.
   * @param {number} [options.deadlineMs] default deadline for every call.
   * @param {string} [options.protoDir] where kvgen/v1/generate.proto lives; default ../../protos.
   */
  constructor(target, options = {}) {
    this.target = target || process.env.KVGEN_TARGET || 'localhost:50051';
    const { Generator } = load(options.protoDir);
    this.apiKey = options.apiKey ?? process.env.KVGEN_API_KEY ?? '';
    this.deadlineMs = options.deadlineMs ?? null;
    this._client = new Generator(
      this.target,
      options.credentials || grpc.credentials.createInsecure(),
      options.channelOptions || {},
    );
  }

  _metadata(opts) {
    const md = new grpc.Metadata();
    if (this.apiKey) md.set('authorization', `Bearer ${this.apiKey}`);
    // Behind a mesh every call of a session carries its id, and the proxy routes by it to the
    // replica that holds the session (deploy/envoy).
    if (opts.sessionId) md.set(SESSION_HEADER, opts.sessionId);
    for (const [k, v] of Object.entries(opts.metadata || {})) md.set(k, v);
    return md;
  }

  _callOptions(opts) {
    const ms = opts.deadlineMs ?? this.deadlineMs;
    return ms != null ? { deadline: new Date(Date.now() + ms) } : {};
  }

  _unary(method, request, opts = {}) {
    return new Promise((resolve, reject) => {
      const call = this._client[method](request, this._metadata(opts), this._callOptions(opts), (err, res) =>
        err ? reject(err) : resolve(res),
      );
      if (opts.signal) {
        if (opts.signal.aborted) call.cancel();
        else opts.signal.addEventListener('abort', () => call.cancel(), { once: true });
      }
    });
  }

  /**
   * Runs one request to completion.
   * @param {string | Array<{role: string, content: string}> | number[]} input
   * @param {object} [sampling] SamplingParams (temperature, top_k, top_p, max_new_tokens, ...)
   * @param {{sessionId?: string, requestId?: string, adapter?: string, deadlineMs?: number, signal?: AbortSignal, metadata?: object}} [opts]
   *   adapter: the LoRA adapter to run with, by name (NOT_FOUND when not loaded); in a session, the session's.
   * @returns {Promise<object>} GenerateResponse
   */
  generate(input, sampling, opts = {}) {
    return this._unary('Generate', buildRequest(input, sampling, opts), opts);
  }

  /**
   * Streams one request: an async iterator of GenerateStreamResponse with `.cancel()`.
   * Same arguments as generate().
   * @returns {GenerateStream}
   */
  stream(input, sampling, opts = {}) {
    const call = this._client.GenerateStream(
      buildRequest(input, sampling, opts),
      this._metadata(opts),
      this._callOptions(opts),
    );
    return cancelOnAbort(new GenerateStream(call), opts.signal);
  }

  /**
   * Runs several requests together; one bad request does not fail the others.
   * @param {Array<{input: any, sampling?: object, sessionId?: string, requestId?: string, adapter?: string}>} requests
   * @param {{deadlineMs?: number, signal?: AbortSignal, metadata?: object}} [opts]
   * @returns {Promise<{results: Array<{result: 'response'|'error', response?: object, error?: {code: number, message: string, details: Array}}>}>}
   */
  batch(requests, opts = {}) {
    const reqs = requests.map((r) => buildRequest(r.input, r.sampling, r));
    return this._unary('BatchGenerate', { requests: reqs }, opts);
  }

  /**
   * Runs several requests together, as batch() does, streaming each one's messages as they are
   * produced; one bad request fails alone (its last message is its error). Cancelling the stream
   * (or opts.signal, or the deadline) ends every request.
   * @param {Array<{input: any, sampling?: object, sessionId?: string, requestId?: string}>} requests
   * @param {{deadlineMs?: number, signal?: AbortSignal, metadata?: object}} [opts]
   * @returns {BatchGenerateStream}
   */
  batchStream(requests, opts = {}) {
    const reqs = requests.map((r) => buildRequest(r.input, r.sampling, r));
    const call = this._client.BatchGenerateStream({ requests: reqs }, this._metadata(opts), this._callOptions(opts));
    return cancelOnAbort(new BatchGenerateStream(call, reqs.length), opts.signal);
  }

  /** @returns {Promise<object>} GetModelInfoResponse */
  modelInfo(opts = {}) {
    return this._unary('GetModelInfo', {}, opts);
  }

  /**
   * Opens a session whose KV cache is kept between calls, under opts.sessionId or a fresh random
   * id chosen here (so that a mesh routes CreateSession itself by it, to where its turns will go).
   * opts.adapter: the LoRA adapter every turn runs with (NOT_FOUND when not loaded).
   * @returns {Promise<{sessionId: string, ttlSeconds: number}>}
   */
  createSession(opts = {}) {
    const sessionId = opts.sessionId || crypto.randomUUID().replace(/-/g, '');
    const req = { sessionId };
    if (opts.adapter) req.adapter = opts.adapter;
    return this._unary('CreateSession', req, { ...opts, sessionId });
  }

  /** Frees a session and its KV cache. */
  async closeSession(sessionId, opts = {}) {
    await this._unary('CloseSession', { sessionId }, { ...opts, sessionId });
  }

  /**
   * Ends running requests by id (on the server this client reaches; behind a mesh, pass the
   * routing key the requests were sent with as opts.sessionId).
   * @returns {Promise<{aborted: string[], unknown: string[]}>}
   */
  abort(requestIds, opts = {}) {
    return this._unary('Abort', { requestIds }, opts);
  }

  /**
   * Loads a LoRA adapter while the server runs, from `path` on the server's file system (a PEFT
   * folder or a llama.cpp GGUF LoRA file); requests may name it once this resolves. Admin-only where
   * the server sets API keys. INVALID_ARGUMENT: a bad or foreign adapter; ALREADY_EXISTS: the name
   * is loaded; RESOURCE_EXHAUSTED: the server's MAX_LORAS are loaded.
   * @returns {Promise<{name: string, rank: number, targetModules: string[]}>} the adapter
   */
  async loadAdapter(name, path, opts = {}) {
    const r = await this._unary('LoadAdapter', { name, path }, opts);
    const { name: loaded, rank, targetModules } = r.adapter;
    return { name: loaded, rank, targetModules };
  }

  /**
   * Unloads an adapter: from the call on, requests naming it get NOT_FOUND; the requests running
   * with it finish first, for up to opts.timeoutSeconds (default: the server's 30 s), else
   * FAILED_PRECONDITION and it stays loaded. NOT_FOUND when no adapter of the name is loaded. Admin-only.
   */
  async unloadAdapter(name, opts = {}) {
    await this._unary('UnloadAdapter', { name, timeoutSeconds: opts.timeoutSeconds ?? 0 }, opts);
  }

  /** @returns {Promise<object>} GetLoadResponse: running, waiting, KV use, tokens/s... */
  load(opts = {}) {
    return this._unary('GetLoad', {}, opts);
  }

  /** Closes the channel. */
  close() {
    this._client.close();
  }
}

/**
 * Whether a session call failed because its session is gone (closed, expired, or its replica
 * died): NOT_FOUND or UNAVAILABLE. The remedy is createSession({sessionId}) again and resending
 * the conversation.
 */
function sessionLost(err) {
  return err != null && (err.code === grpc.status.NOT_FOUND || err.code === grpc.status.UNAVAILABLE);
}

module.exports = {
  KvgenClient,
  SESSION_HEADER,
  sessionLost,
  GenerateStream,
  BatchGenerateStream,
  buildRequest,
  badRequestFields,
  errorDetails,
  retryDelayMs,
  rpcStatus,
  status: grpc.status,
  grpc,
};

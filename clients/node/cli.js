#!/usr/bin/env node
'use strict';
// Streams one generation to stdout:
//   node cli.js "prompt" [--chat] [--max-new-tokens N] [--temperature T] [--target host:port]

const fs = require('node:fs');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const { KvgenClient, badRequestFields, status } = require('./index.js');

const USAGE = `usage: node cli.js "prompt" [options]

options:
  --chat                 send the prompt as one user chat message (the model's chat template applies)
  --max-new-tokens N     tokens to generate (server default: 256)
  --temperature T        0 = greedy (server default: 1.0)
  --top-k K, --top-p P, --min-p P, --seed N
  --presence-penalty X, --frequency-penalty X   in [-2, 2]
  --min-new-tokens N     no stop token before N tokens
  --logit-bias ID=BIAS   add BIAS to token ID's logit (repeatable)
  --stop TEXT            stop string (repeatable)
  --json-schema SCHEMA   the output is JSON valid against SCHEMA (JSON text, or @file)
  --json-object          the output is a JSON object
  --regex RE             the output matches RE
  --grammar LARK         the output parses with this Lark grammar (text, or @file)
  --choice TEXT          the output is one of the --choice values (repeatable)
  --target host:port     server address (default: $KVGEN_TARGET or localhost:50051)
  --api-key KEY          bearer token (default: $KVGEN_API_KEY)
  --tls                  connect with TLS, verifying the server by the system's roots
  --ca-file PEM          connect with TLS, verifying the server by this CA
  --cert-file PEM        this client's certificate, for a server that requires one (mTLS)
  --key-file PEM         the private key of --cert-file
  --verbose              print finish reason, usage and timings to stderr
  -h, --help             this help
`;

function number(name, value, integer) {
  if (value === undefined) return undefined;
  const n = Number(value);
  if (value.trim() === '' || !Number.isFinite(n) || (integer && !Number.isInteger(n))) {
    throw new Error(`--${name} wants ${integer ? 'an integer' : 'a number'}, got ${JSON.stringify(value)}`);
  }
  return n;
}

// "@path" reads a file (a schema or a grammar is rarely one shell word).
function textOrFile(value) {
  return value.startsWith('@') ? fs.readFileSync(value.slice(1), 'utf8') : value;
}

// At most one constraint, as the API's oneof takes it.
function constraintOf(values) {
  const given = {
    jsonSchema: values['json-schema'] !== undefined ? textOrFile(values['json-schema']) : undefined,
    jsonObject: values['json-object'] || undefined,
    regex: values.regex,
    grammar: values.grammar !== undefined ? textOrFile(values.grammar) : undefined,
    choice: values.choice ? { choices: values.choice } : undefined,
  };
  const set = Object.entries(given).filter(([, v]) => v !== undefined);
  if (set.length > 1) throw new Error('give at most one of --json-schema, --json-object, --regex, --grammar, --choice');
  return Object.fromEntries(set);
}

function logitBiasOf(items) {
  const bias = {};
  for (const item of items) {
    const m = /^(\d+)=(-?[0-9.]+)$/.exec(item);
    if (!m) throw new Error(`--logit-bias wants TOKEN_ID=BIAS, got ${JSON.stringify(item)}`);
    bias[m[1]] = Number(m[2]);
  }
  return bias;
}

// TLS when asked for or when any certificate file is given; insecure (undefined) otherwise.
function credentialsOf(values) {
  const { tls, 'ca-file': ca, 'cert-file': cert, 'key-file': key } = values;
  if (!tls && !ca && !cert && !key) return undefined;
  if (Boolean(cert) !== Boolean(key)) throw new Error('--cert-file and --key-file go together');
  const read = (file) => (file ? fs.readFileSync(file) : null);
  return grpc.credentials.createSsl(read(ca), read(key), read(cert));
}

async function main(argv) {
  let args;
  try {
    args = parseArgs({
      args: argv,
      allowPositionals: true,
      options: {
        chat: { type: 'boolean', default: false },
        'max-new-tokens': { type: 'string' },
        temperature: { type: 'string' },
        'top-k': { type: 'string' },
        'top-p': { type: 'string' },
        'min-p': { type: 'string' },
        seed: { type: 'string' },
        'presence-penalty': { type: 'string' },
        'frequency-penalty': { type: 'string' },
        'min-new-tokens': { type: 'string' },
        'logit-bias': { type: 'string', multiple: true },
        stop: { type: 'string', multiple: true },
        'json-schema': { type: 'string' },
        'json-object': { type: 'boolean', default: false },
        regex: { type: 'string' },
        grammar: { type: 'string' },
        choice: { type: 'string', multiple: true },
        target: { type: 'string' },
        'api-key': { type: 'string' },
        tls: { type: 'boolean', default: false },
        'ca-file': { type: 'string' },
        'cert-file': { type: 'string' },
        'key-file': { type: 'string' },
        verbose: { type: 'boolean', default: false },
        help: { type: 'boolean', short: 'h', default: false },
      },
    });
  } catch (e) {
    process.stderr.write(`${e.message}\n\n${USAGE}`);
    return 2;
  }
  const { values, positionals } = args;
  if (values.help) {
    process.stdout.write(USAGE);
    return 0;
  }
  if (positionals.length !== 1) {
    process.stderr.write(USAGE);
    return 2;
  }
  let sampling;
  let credentials;
  try {
    sampling = {
      maxNewTokens: number('max-new-tokens', values['max-new-tokens'], true),
      temperature: number('temperature', values.temperature, false),
      topK: number('top-k', values['top-k'], true),
      topP: number('top-p', values['top-p'], false),
      minP: number('min-p', values['min-p'], false),
      seed: number('seed', values.seed, true),
      presencePenalty: number('presence-penalty', values['presence-penalty'], false),
      frequencyPenalty: number('frequency-penalty', values['frequency-penalty'], false),
      minNewTokens: number('min-new-tokens', values['min-new-tokens'], true),
      stopStrings: values.stop,
      ...constraintOf(values),
    };
    if (values['logit-bias']) sampling.logitBias = logitBiasOf(values['logit-bias']);
    credentials = credentialsOf(values);
  } catch (e) {
    process.stderr.write(`${e.message}\n`);
    return 2;
  }
  const prompt = positionals[0];
  const input = values.chat ? [{ role: 'user', content: prompt }] : prompt;

  const client = new KvgenClient(values.target, { apiKey: values['api-key'], credentials });
  const stream = client.stream(input, sampling);
  const onSigint = () => stream.cancel();
  process.once('SIGINT', onSigint);
  let last = null;
  try {
    for await (const msg of stream) {
      if (msg.text) process.stdout.write(msg.text);
      last = msg;
    }
    process.stdout.write('\n');
    if (stream.cancelled) return 130;
    if (values.verbose && last) {
      const u = last.usage || {};
      const t = last.timings || {};
      process.stderr.write(
        `[${last.finishReason}${last.matchedStop ? ` ${JSON.stringify(last.matchedStop)}` : ''}] ` +
          `prompt ${u.promptTokens} + completion ${u.completionTokens} tokens (cached ${u.cachedTokens}), ` +
          `first token ${t.timeToFirstTokenMs?.toFixed(0)} ms, total ${t.totalMs?.toFixed(0)} ms\n`,
      );
    }
    return 0;
  } catch (err) {
    const name = Object.keys(status).find((k) => status[k] === err.code) ?? String(err.code);
    process.stderr.write(`\nerror: ${name}: ${err.details ?? err.message}\n`);
    for (const v of badRequestFields(err)) process.stderr.write(`  ${v.field}: ${v.description}\n`);
    return 1;
  } finally {
    process.removeListener('SIGINT', onSigint);
    client.close();
  }
}

main(process.argv.slice(2)).then((code) => {
  process.exitCode = code;
});

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
    };
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

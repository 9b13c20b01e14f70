'use strict';
// Structured output and sampling controls through the Node client and its CLI, against a real
// server (KVGEN_TARGET): a schema as an object, choices as an array, Lark, a bad regex's field.

const { describe, test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { execFile } = require('node:child_process');
const { promisify } = require('node:util');
const { KvgenClient, badRequestFields, status } = require('../index.js');

const TARGET = process.env.KVGEN_TARGET;
const SCHEMA = {
  type: 'object',
  properties: { city: { type: 'string', maxLength: 20 }, rank: { type: 'integer', minimum: 1, maximum: 9 } },
  required: ['city', 'rank'],
  additionalProperties: false,
};
const ASK = [{ role: 'user', content: 'Name a city and its rank as JSON.' }];

describe('structured output', { skip: TARGET ? false : 'KVGEN_TARGET is not set' }, () => {
  let client;
  before(() => {
    client = new KvgenClient(TARGET, { deadlineMs: 60_000 });
  });
  after(() => client?.close());

  test('a JSON schema given as an object', async () => {
    const r = await client.generate(ASK, { temperature: 0.8, seed: 4, maxNewTokens: 60, jsonSchema: SCHEMA });
    const v = JSON.parse(r.text);
    assert.equal(typeof v.city, 'string');
    assert.ok(Number.isInteger(v.rank) && v.rank >= 1 && v.rank <= 9);
    assert.equal(r.finishReason, 'FINISH_REASON_STOP_TOKEN');
  });

  test('choices as an array, streamed; Lark in a batch', async () => {
    let text = '';
    for await (const m of client.stream(ASK, { choice: ['Paris', 'Rome'] })) text += m.text;
    assert.ok(['Paris', 'Rome'].includes(text), text);
    const out = await client.batch([
      { input: 'Count:', sampling: { maxNewTokens: 30, grammar: 'start: NUM ("," NUM)~2\nNUM: /[0-9]/' } },
      { input: 'Hi', sampling: { regex: '((' } },
    ]);
    assert.match(out.results[0].response.text, /^[0-9],[0-9](,[0-9])?$/);
    assert.equal(out.results[1].error.code, status.INVALID_ARGUMENT);
    assert.deepEqual(badRequestFields(out.results[1].error).map((v) => v.field), ['sampling.regex']);
  });

  test('sampling controls and prompt logprobs', async () => {
    const r = await client.generate('One two three', {
      temperature: 0, maxNewTokens: 3, minP: 0.1, presencePenalty: 0.5, frequencyPenalty: 0.5,
      logitBias: { 13: -100 }, minNewTokens: 3, promptLogprobs: 1,
    });
    assert.equal(r.tokenIds.length, 3);
    assert.ok(!r.tokenIds.includes(13));
    assert.equal(r.promptLogprobs.length, r.usage.promptTokens);
    assert.ok(r.promptLogprobs.slice(1).every((p) => p.logprob < 0 && p.top.length === 1));
  });

  test('a bad regex is INVALID_ARGUMENT naming sampling.regex', async () => {
    await assert.rejects(client.generate('hi', { regex: '((' }), (err) => {
      assert.equal(err.code, status.INVALID_ARGUMENT);
      assert.deepEqual(badRequestFields(err).map((v) => v.field), ['sampling.regex']);
      return true;
    });
  });

  test('the CLI takes constraints', async () => {
    const cli = path.join(__dirname, '..', 'cli.js');
    const run = promisify(execFile);
    const { stdout } = await run('node', [cli, 'Is water wet?', '--chat', '--target', TARGET,
      '--choice', 'yes', '--choice', 'no']);
    assert.ok(['yes', 'no'].includes(stdout.trim()), stdout);
    const json = await run('node', [cli, 'A city as JSON.', '--chat', '--target', TARGET, '--temperature', '0',
      '--max-new-tokens', '60', '--json-schema', JSON.stringify(SCHEMA)]);
    assert.equal(typeof JSON.parse(json.stdout).city, 'string');
    await assert.rejects(run('node', [cli, 'hi', '--target', TARGET, '--regex', '((']),
      (err) => err.code === 1 && /sampling\.regex/.test(err.stderr));
  });
});

'use strict';
// LoRA adapters against a running server that loaded one: KVGEN_LORA_TARGET=host:port,
// KVGEN_ADAPTER=its name, KVGEN_ADAPTER_PATH=its folder on the server's disk (random weights, large
// enough to change greedy tokens). tests/service/test_node_client.py starts that server.

const { describe, test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { KvgenClient, status } = require('../index.js');

const TARGET = process.env.KVGEN_LORA_TARGET;
const NAME = process.env.KVGEN_ADAPTER;
const PATH = process.env.KVGEN_ADAPTER_PATH;
const PROMPT = 'Once upon a time';
const SAMPLING = { temperature: 0, maxNewTokens: 8, ignoreEos: true };

describe('LoRA adapters', { skip: TARGET && NAME && PATH ? false : 'KVGEN_LORA_TARGET, KVGEN_ADAPTER, KVGEN_ADAPTER_PATH unset' }, () => {
  let client;
  before(() => {
    client = new KvgenClient(TARGET, { deadlineMs: 60_000 });
  });
  after(() => client?.close());

  test('an adapter changes the greedy tokens, in generate, stream, batch and a session', async () => {
    const base = (await client.generate(PROMPT, SAMPLING)).tokenIds;
    const tuned = (await client.generate(PROMPT, SAMPLING, { adapter: NAME })).tokenIds;
    assert.notDeepEqual(tuned, base);
    assert.deepEqual((await client.stream(PROMPT, SAMPLING, { adapter: NAME }).collect()).tokenIds, tuned);
    const batch = await client.batch([{ input: PROMPT, sampling: SAMPLING }, { input: PROMPT, sampling: SAMPLING, adapter: NAME }]);
    assert.deepEqual(batch.results.map((r) => r.response.tokenIds), [base, tuned]);
    const { sessionId } = await client.createSession({ adapter: NAME });
    try {
      // the session's adapter, though the turn names none
      assert.deepEqual((await client.generate(PROMPT, SAMPLING, { sessionId })).tokenIds, tuned);
    } finally {
      await client.closeSession(sessionId);
    }
  });

  test('an unknown adapter is NOT_FOUND', async () => {
    const notFound = (err) => err.code === status.NOT_FOUND;
    await assert.rejects(client.generate(PROMPT, SAMPLING, { adapter: 'no-such-adapter' }), notFound);
    await assert.rejects(client.createSession({ adapter: 'no-such-adapter' }), notFound);
    await assert.rejects(client.unloadAdapter('no-such-adapter'), notFound);
  });

  test('unloadAdapter then loadAdapter', async () => {
    const before = (await client.generate(PROMPT, SAMPLING, { adapter: NAME })).tokenIds;
    await client.unloadAdapter(NAME);
    await assert.rejects(client.generate(PROMPT, SAMPLING, { adapter: NAME }), (err) => err.code === status.NOT_FOUND);
    const a = await client.loadAdapter(NAME, PATH);
    assert.equal(a.name, NAME);
    assert.ok(a.rank > 0 && a.targetModules.length > 0, JSON.stringify(a));
    await assert.rejects(client.loadAdapter(NAME, PATH), (err) => err.code === status.ALREADY_EXISTS);
    assert.deepEqual((await client.generate(PROMPT, SAMPLING, { adapter: NAME })).tokenIds, before);
  });
});

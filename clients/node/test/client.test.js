'use strict';
// Integration tests against a running kvgen server: KVGEN_TARGET=host:port node --test test/
// (tests/test_node_client.py starts one in-process and runs these).

const { describe, test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { KvgenClient, badRequestFields, status } = require('../index.js');

const TARGET = process.env.KVGEN_TARGET;
const GREEDY = { temperature: 0 };
const CHAT = [{ role: 'user', content: 'Write one sentence about the sea.' }];

describe('KvgenClient', { skip: TARGET ? false : 'KVGEN_TARGET is not set' }, () => {
  let client;
  before(() => {
    client = new KvgenClient(TARGET, { deadlineMs: 60_000 });
  });
  after(() => client?.close());

  test('unary greedy generation', async () => {
    const r = await client.generate('The capital of France is', { ...GREEDY, max_new_tokens: 8 });
    assert.ok(r.text.startsWith(' Paris'), JSON.stringify(r.text));
    assert.equal(r.tokenIds.length, 8);
    assert.equal(r.finishReason, 'FINISH_REASON_LENGTH');
    assert.deepEqual(r.usage, { promptTokens: 5, completionTokens: 8, cachedTokens: 0 });
    assert.ok(r.requestId);
    assert.ok(r.timings.totalMs >= r.timings.timeToFirstTokenMs && r.timings.timeToFirstTokenMs > 0);
  });

  test('stream deltas concatenate to the unary text', async () => {
    const sampling = { ...GREEDY, maxNewTokens: 24 };
    const unary = await client.generate(CHAT, sampling, { requestId: 'node-req-1' });
    const msgs = [];
    for await (const m of client.stream(CHAT, sampling, { requestId: 'node-req-1' })) msgs.push(m);
    assert.ok(msgs.length > 1);
    assert.equal(msgs.map((m) => m.text).join(''), unary.text);
    assert.deepEqual(msgs.flatMap((m) => m.tokenIds), unary.tokenIds);
    assert.ok(msgs.every((m) => m.requestId === 'node-req-1'));
    assert.ok(msgs.slice(0, -1).every((m) => m.finishReason === 'FINISH_REASON_UNSPECIFIED'));
    const last = msgs[msgs.length - 1];
    assert.equal(last.finishReason, unary.finishReason);
    assert.equal(last.usage.promptTokens, unary.usage.promptTokens);
    assert.equal(last.usage.completionTokens, unary.usage.completionTokens);
    // the same prompt again: its full blocks come from the server's prefix cache
    assert.ok(last.usage.cachedTokens >= unary.usage.cachedTokens);
    assert.ok(last.usage.cachedTokens > 0);
  });

  test('chat messages input uses the chat template', async () => {
    const r = await client.generate(CHAT, { ...GREEDY, max_new_tokens: 40 });
    assert.equal(r.finishReason, 'FINISH_REASON_STOP_TOKEN');
    assert.equal(r.matchedStop, '<|im_end|>');
    assert.ok(r.text.length > 0);
    // the template wraps the 8-token message in role markers and adds the generation prompt
    const plain = await client.generate(CHAT[0].content, { ...GREEDY, max_new_tokens: 1 });
    assert.ok(r.usage.promptTokens > plain.usage.promptTokens + 5);
  });

  test('prompt token ids input', async () => {
    const text = await client.generate('The capital of France is', { ...GREEDY, max_new_tokens: 4 });
    const ids = await client.generate(text.tokenIds, { ...GREEDY, max_new_tokens: 2 });
    assert.equal(ids.usage.promptTokens, text.tokenIds.length);
    assert.equal(ids.tokenIds.length, 2);
  });

  test('batch with one invalid entry', async () => {
    const out = await client.batch([
      { input: 'The capital of France is', sampling: { ...GREEDY, max_new_tokens: 6 } },
      { input: [1, 2, 99999999], sampling: { max_new_tokens: 4 } },
      { input: CHAT, sampling: { ...GREEDY, max_new_tokens: 6 } },
    ]);
    assert.deepEqual(out.results.map((r) => r.result), ['response', 'error', 'response']);
    const err = out.results[1].error;
    assert.equal(err.code, 3);
    assert.equal(err.code, status.INVALID_ARGUMENT);
    assert.match(err.message, /99999999/);
    assert.deepEqual(badRequestFields(err).map((v) => v.field), ['prompt_token_ids']);
    const solo = await client.generate('The capital of France is', { ...GREEDY, max_new_tokens: 6 });
    assert.deepEqual(out.results[0].response.tokenIds, solo.tokenIds);
  });

  test('batch stream: each entry streams as it would alone, a bad one fails alone', async () => {
    const entries = [
      { input: 'The capital of France is', sampling: { ...GREEDY, max_new_tokens: 6 } },
      { input: [1, 2, 99999999], sampling: { max_new_tokens: 4 } },
      { input: CHAT, sampling: { ...GREEDY, max_new_tokens: 6 } },
    ];
    const msgs = [];
    for await (const m of client.batchStream(entries)) msgs.push(m);
    assert.deepEqual([...new Set(msgs.map((m) => m.index))].sort(), [0, 1, 2]);
    const bad = msgs.filter((m) => m.index === 1);
    assert.equal(bad.length, 1);
    assert.equal(bad[0].result, 'error');
    assert.equal(bad[0].error.code, status.INVALID_ARGUMENT);
    assert.deepEqual(badRequestFields(bad[0].error).map((v) => v.field), ['prompt_token_ids']);
    for (const i of [0, 2]) {
      const mine = msgs.filter((m) => m.index === i).map((m) => m.response);
      const alone = await client.stream(entries[i].input, entries[i].sampling).collect();
      assert.deepEqual(mine.flatMap((m) => m.tokenIds), alone.tokenIds);
      assert.equal(mine[mine.length - 1].finishReason, alone.last.finishReason);
    }
    const collected = await client.batchStream(entries).collect();
    assert.equal(collected[1].error.code, status.INVALID_ARGUMENT);
    assert.equal(collected[0].tokenIds.length, 6);
    assert.equal(collected[2].last.usage.completionTokens, 6);
  });

  test('cancelling a batch stream ends every entry', async () => {
    const long = { max_new_tokens: 2000, ignore_eos: true };
    const s = client.batchStream([{ input: 'Once upon a time', sampling: long }, { input: 'Far away', sampling: long }]);
    const seen = new Set();
    for await (const m of s) {
      seen.add(m.index);
      if (seen.size === 2) s.cancel();
    }
    assert.ok(s.cancelled);
    let load = await client.load();
    for (let i = 0; i < 100 && (load.runningRequests > 0 || load.kvBlocksUsed > 0); i++) {
      await new Promise((r) => setTimeout(r, 50));
      load = await client.load();
    }
    assert.equal(load.runningRequests, 0);
    assert.equal(load.kvBlocksUsed, 0);
  });

  test('INVALID_ARGUMENT names the field', async () => {
    await assert.rejects(client.generate('hi', { top_p: 2 }), (err) => {
      assert.equal(err.code, status.INVALID_ARGUMENT);
      const fields = badRequestFields(err);
      assert.deepEqual(fields.map((v) => v.field), ['sampling.top_p']);
      assert.ok(fields[0].description);
      return true;
    });
    // errors of streams reject the iteration the same way
    await assert.rejects(
      (async () => {
        for await (const _ of client.stream('hi', { temperature: -1 })); // eslint-disable-line no-unused-vars
      })(),
      (err) => err.code === status.INVALID_ARGUMENT && badRequestFields(err)[0].field === 'sampling.temperature',
    );
  });

  test('cancel a long stream mid-way', async () => {
    const s = client.stream('Once upon a time', { max_new_tokens: 2000, ignore_eos: true });
    const started = Date.now();
    let tokens = 0;
    for await (const m of s) {
      tokens += m.tokenIds.length;
      if (tokens >= 3) s.cancel();
    }
    assert.ok(s.cancelled);
    assert.ok(tokens >= 3 && tokens < 2000);
    assert.ok(Date.now() - started < 30_000);
    // the server is still serving afterwards
    const r = await client.generate('The capital of France is', { ...GREEDY, max_new_tokens: 2 });
    assert.equal(r.tokenIds.length, 2);
  });

  test('deadline exceeded', async () => {
    const s = client.stream('Once upon a time', { max_new_tokens: 2000, ignore_eos: true }, { deadlineMs: 300 });
    await assert.rejects(s.collect(), (err) => err.code === status.DEADLINE_EXCEEDED);
  });

  test('sessions reuse the cached conversation', async () => {
    const { sessionId, ttlSeconds } = await client.createSession();
    assert.ok(sessionId && ttlSeconds > 0);
    const sampling = { ...GREEDY, max_new_tokens: 4 };
    const r1 = await client.generate([{ role: 'user', content: 'Name a fruit.' }], sampling, { sessionId });
    const r2 = await client.generate([{ role: 'user', content: 'Now a vegetable.' }], sampling, { sessionId });
    assert.ok(r2.usage.cachedTokens > r1.usage.promptTokens);
    await client.closeSession(sessionId);
    await assert.rejects(client.generate('hi', { max_new_tokens: 1 }, { sessionId }), { code: status.NOT_FOUND });
  });

  test('a client-chosen session id, sent as x-session-id metadata', async () => {
    const { sessionId } = await client.createSession({ sessionId: 'node-chosen-1' });
    assert.equal(sessionId, 'node-chosen-1');
    const picked = await client.createSession();
    assert.match(picked.sessionId, /^[0-9a-f]{32}$/);
    const r = await client.generate('hi', { max_new_tokens: 1 }, { sessionId });
    assert.equal(r.tokenIds.length, 1);
    // the metadata is there: one that disagrees with the body is refused
    await assert.rejects(
      client.generate('hi', { max_new_tokens: 1 }, { sessionId, metadata: { 'x-session-id': 'other' } }),
      (err) => err.code === status.INVALID_ARGUMENT && badRequestFields(err)[0].field === 'session_id',
    );
    await client.closeSession(sessionId);
    await client.closeSession(picked.sessionId);
  });

  test('Abort from a second client ends a stream; GetLoad', async () => {
    const s = client.stream('Once upon a time', { max_new_tokens: 2000, ignore_eos: true }, { requestId: 'node-long' });
    const it = s[Symbol.asyncIterator]();
    assert.ok((await it.next()).value.tokenIds.length > 0);
    const other = new KvgenClient(TARGET);
    const out = await other.abort(['node-long', 'nope']);
    assert.deepEqual([out.aborted, out.unknown], [['node-long'], ['nope']]);
    await assert.rejects(async () => {
      for (;;) if ((await it.next()).done) break;
    }, (err) => err.code === status.CANCELLED);
    const load = await other.load();
    assert.equal(load.runningRequests, 0);
    assert.ok(load.kvBlocksTotal > 0 && load.accepting);
    other.close();
  });

  test('model info', async () => {
    const info = await client.modelInfo();
    assert.equal(info.architecture, 'llama');
    assert.equal(info.numLayers, 30);
    assert.ok(info.vocabSize > 0 && info.contextLength > 0);
    assert.ok(info.hasChatTemplate);
  });
});

'use strict';
// Runs against a live engine or router: NANOSERVE_TARGET=HOST:PORT (required: without it
// these tests fail, they never skip). NANOSERVE_EXPECT_JSON=FILE (optional) names a JSON
// file written by the Python side: {"prompt", "sampling", "token_ids", "text"}; the stream
// must reproduce its token ids and text exactly. NANOSERVE_TLS_CA=FILE (optional) connects
// over TLS, verifying the server against that CA; NANOSERVE_TLS_CERT and NANOSERVE_TLS_KEY
// (optional) add a client certificate. NANOSERVE_API_KEY=KEY (optional) sends that API key,
// and checks that a client without it is refused.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { spawnSync } = require('node:child_process');
const grpc = require('@grpc/grpc-js');
const {
  Client, buildRequest, InvalidArgument, DeadlineExceeded, NanoserveError,
} = require('..');

const TARGET = process.env.NANOSERVE_TARGET;
const EXPECT_JSON = process.env.NANOSERVE_EXPECT_JSON;
const DEFAULT_SPEC = { prompt: 'Hello', sampling: { max_tokens: 8, temperature: 0 } };

function requireTarget({ apiKey = process.env.NANOSERVE_API_KEY } = {}) {
  assert.ok(TARGET, 'set NANOSERVE_TARGET=HOST:PORT of a running nanoserve engine or router');
  const env = process.env;
  return new Client(TARGET, {
    timeout: 120, tlsCa: env.NANOSERVE_TLS_CA, tlsCert: env.NANOSERVE_TLS_CERT,
    tlsKey: env.NANOSERVE_TLS_KEY, apiKey,
  });
}

test('buildRequest maps prompts and options onto the proto', () => {
  assert.equal(buildRequest('hi').text, 'hi');
  assert.deepEqual(buildRequest([1, 2, 3]).token_ids, { ids: [1, 2, 3] });
  const chat = buildRequest([{ role: 'user', content: 'hi' }], { request_id: 'r1' });
  assert.deepEqual(chat.messages, { messages: [{ role: 'user', content: 'hi' }] });
  assert.equal(chat.request_id, 'r1');
  const req = buildRequest('x', { max_tokens: 4, stop: 'END', temperature: null });
  assert.deepEqual(req.sampling, { max_tokens: 4, stop: ['END'] });
  assert.throws(() => buildRequest('x', { max_token: 4 }), /unknown option\(s\): max_token/);
  assert.throws(() => buildRequest([1, 'a']), TypeError);
  // A value the proto cannot hold is refused here; grpc-js would wrap -1 into 4294967295.
  assert.throws(() => buildRequest('x', { max_tokens: -1 }),
                { name: 'RangeError',
                  message: 'max_tokens must be an integer in [0, 4294967295], got -1' });
  assert.throws(() => buildRequest('x', { stop_token_ids: [1, 2.5] }), /stop_token_ids\[1\]/);
  assert.throws(() => buildRequest([3, -1]), /token_ids\[1\] must be an integer/);
});

test('the README snippet runs as written', (t) => {
  requireTarget().close();
  if (process.env.NANOSERVE_TLS_CA) {
    t.skip('the snippet speaks plaintext; the plaintext run of this suite covers it');
    return;
  }
  const readme = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
  const snippet = readme.match(/```js\n([\s\S]*?)```/)[1];
  // From stdin with the repository root as working directory: what `node example.js` does
  // with the file saved there, as the README says.
  const run = spawnSync(process.execPath, ['-'], {
    input: snippet, cwd: path.resolve(__dirname, '..', '..', '..'), encoding: 'utf8',
    timeout: 60000,
  });
  assert.equal(run.status, 0, `${run.stdout}\n${run.stderr}`);
  assert.match(run.stdout, /refused: max_tokens must be/);
});

test('stream reproduces the expected greedy tokens and equals generate', async () => {
  const client = requireTarget();
  const spec = EXPECT_JSON ? JSON.parse(fs.readFileSync(EXPECT_JSON, 'utf8')) : DEFAULT_SPEC;
  try {
    const chunks = [];
    for await (const chunk of client.stream(spec.prompt, spec.sampling)) chunks.push(chunk);
    const ids = chunks.flatMap((c) => c.token_ids);
    const text = chunks.map((c) => c.text).join('');
    const last = chunks[chunks.length - 1];
    assert.ok(['stop', 'length'].includes(last.finish_reason), `finish ${last.finish_reason}`);
    assert.equal(last.usage.completion_tokens, ids.length);
    assert.ok(chunks.slice(0, -1).every((c) => c.finish_reason === null && c.usage === null));
    if (spec.token_ids !== undefined) {
      assert.deepEqual(ids, spec.token_ids);
      assert.equal(text, spec.text);
    }
    const whole = await client.generate(spec.prompt, spec.sampling);
    assert.deepEqual(whole.token_ids, ids);
    assert.equal(whole.text, text);
    assert.equal(whole.finish_reason, last.finish_reason);
  } finally {
    client.close();
  }
});

test('leaving a stream early cancels it without crashing', async () => {
  const client = requireTarget();
  try {
    const requestId = `node-early-close-${process.pid}`;
    let seen = 0;
    const options = { max_tokens: 200, ignore_eos: true, temperature: 0, request_id: requestId };
    for await (const chunk of client.stream('Hello', options)) {
      seen += chunk.token_ids.length;
      break;
    }
    assert.ok(seen >= 1);
    // The channel still works after the cancellation.
    const result = await client.generate('Hello', { max_tokens: 2, temperature: 0 });
    assert.ok(result.token_ids.length >= 1);
  } finally {
    client.close();
  }
});

test('apiKey is sent as bearer metadata; without it the server refuses', async (t) => {
  if (!process.env.NANOSERVE_API_KEY) {
    t.skip('the server needs no key (set NANOSERVE_API_KEY for one started with --api-key)');
    return;
  }
  const keyless = requireTarget({ apiKey: null });
  const wrong = requireTarget({ apiKey: 'wrong-key' });
  try {
    for (const client of [keyless, wrong]) {
      await assert.rejects(client.generate('Hello', { max_tokens: 2 }), (err) => {
        assert.ok(err instanceof NanoserveError, `got ${err}`);
        assert.equal(err.grpcCode, grpc.status.UNAUTHENTICATED);
        return true;
      });
    }
  } finally {
    keyless.close();
    wrong.close();
  }
});

test('server errors become typed errors', async () => {
  const client = requireTarget();
  try {
    await assert.rejects(client.generate('Hello', { max_tokens: 0 }), (err) => {
      assert.ok(err instanceof InvalidArgument, `got ${err}`);
      assert.ok(err instanceof NanoserveError);
      assert.equal(err.code, 'INVALID_ARGUMENT');
      assert.match(err.details, /max_tokens/);
      return true;
    });
    // A deadline that has already passed fails on the client side, whatever the server.
    await assert.rejects(client.generate('Hello', { max_tokens: 4, timeout: -1 }),
                         DeadlineExceeded);
  } finally {
    client.close();
  }
});

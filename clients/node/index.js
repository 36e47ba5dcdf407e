'use strict';
// Node.js client for nanoserve: the same Generation service a router and every engine serve.
// Loads the .proto at run time (no generated code), so it follows the contract in
// proto/nanoserve/v1/nanoserve.proto. Option names are the proto's snake_case field names,
// exactly as in the Python client.

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');
const PROTO_FILE = 'nanoserve/v1/nanoserve.proto';
const LOADER_OPTIONS = {
  keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
  includeDirs: [PROTO_ROOT],
};

const packageDefinition = protoLoader.loadSync(PROTO_FILE, LOADER_OPTIONS);
const v1 = grpc.loadPackageDefinition(packageDefinition).nanoserve.v1;

// Taken from the proto so a new sampling field needs no client change.
const SAMPLING_DESCRIPTOR = packageDefinition['nanoserve.v1.SamplingParams'].type.field;
const SAMPLING_FIELDS = new Set(SAMPLING_DESCRIPTOR.map((f) => f.name));
const REPEATED_FIELDS = new Set(
  SAMPLING_DESCRIPTOR.filter((f) => f.label === 'LABEL_REPEATED').map((f) => f.name));
const CALL_OPTIONS = new Set(['request_id', 'timeout']);
// What each integer type of the wire can hold: grpc-js would wrap max_tokens: -1 into
// 4294967295. Ranges that mean something to the model are the server's check.
const INT_RANGES = {
  TYPE_UINT32: [0, 2 ** 32 - 1], TYPE_INT32: [-(2 ** 31), 2 ** 31 - 1],
  TYPE_UINT64: [0, Number.MAX_SAFE_INTEGER],
  TYPE_INT64: [-Number.MAX_SAFE_INTEGER, Number.MAX_SAFE_INTEGER],
};
const FIELD_RANGES = new Map(SAMPLING_DESCRIPTOR.filter((f) => INT_RANGES[f.type])
  .map((f) => [f.name, INT_RANGES[f.type]]));

// RangeError naming the field and its range unless value (each value of an array) is an
// integer within it.
function checkInteger(name, value, [low, high]) {
  if (Array.isArray(value)) {
    value.forEach((v, i) => checkInteger(`${name}[${i}]`, v, [low, high]));
  } else if (!Number.isInteger(value) || value < low || value > high) {
    throw new RangeError(`${name} must be an integer in [${low}, ${high}], ` +
                         `got ${JSON.stringify(value)}`);
  }
}

class NanoserveError extends Error {
  // code: the status name ("INVALID_ARGUMENT"); grpcCode: its number; details: server text.
  constructor(grpcCode, details) {
    const code = grpc.status[grpcCode] || 'UNKNOWN';
    super(`${code}: ${details}`);
    this.name = this.constructor.name;
    this.code = code;
    this.grpcCode = grpcCode;
    this.details = details;
  }
}
class InvalidArgument extends NanoserveError {}
class ResourceExhausted extends NanoserveError {}
class Unavailable extends NanoserveError {}
class DeadlineExceeded extends NanoserveError {}
class Cancelled extends NanoserveError {}

const ERROR_CLASSES = {
  [grpc.status.INVALID_ARGUMENT]: InvalidArgument,
  [grpc.status.RESOURCE_EXHAUSTED]: ResourceExhausted,
  [grpc.status.UNAVAILABLE]: Unavailable,
  [grpc.status.DEADLINE_EXCEEDED]: DeadlineExceeded,
  [grpc.status.CANCELLED]: Cancelled,
};

function toNanoserveError(err) {
  if (err instanceof NanoserveError || typeof err.code !== 'number') return err;
  const Cls = ERROR_CLASSES[err.code] || NanoserveError;
  return new Cls(err.code, err.details ?? err.message);
}

function setPrompt(request, prompt) {
  if (typeof prompt === 'string') {
    request.text = prompt;
    return;
  }
  if (!Array.isArray(prompt)) {
    throw new TypeError('prompt must be a string, an array of token ids or an array of ' +
                        '{role, content} messages');
  }
  if (prompt.length === 0) throw new RangeError('prompt must not be an empty array');
  if (prompt.every((x) => typeof x === 'number')) {
    checkInteger('token_ids', prompt, INT_RANGES.TYPE_UINT32);
    request.token_ids = { ids: prompt };
  } else if (prompt.every((m) => m && typeof m.role === 'string' &&
                                 typeof m.content === 'string')) {
    request.messages = { messages: prompt.map((m) => ({ role: m.role, content: m.content })) };
  } else {
    throw new TypeError('an array prompt must hold only integers (token ids) or only ' +
                        '{role, content} messages');
  }
}

// A GenerateRequest object from a prompt and sampling options (proto field names). Unknown
// options throw a TypeError naming them; null/undefined values are left unset.
function buildRequest(prompt, options = {}) {
  const unknown = Object.keys(options)
    .filter((k) => !SAMPLING_FIELDS.has(k) && !CALL_OPTIONS.has(k));
  if (unknown.length > 0) {
    throw new TypeError(`unknown option(s): ${unknown.join(', ')} ` +
                        `(expected ${[...SAMPLING_FIELDS, ...CALL_OPTIONS].join(', ')})`);
  }
  const request = { request_id: options.request_id || '', sampling: {} };
  setPrompt(request, prompt);
  for (const [name, value] of Object.entries(options)) {
    if (!SAMPLING_FIELDS.has(name) || value === null || value === undefined) continue;
    // `stop: "x"` means one stop string, as in the Python client
    const v = REPEATED_FIELDS.has(name) && !Array.isArray(value) ? [value] : value;
    if (FIELD_RANGES.has(name)) checkInteger(name, v, FIELD_RANGES.get(name));
    request.sampling[name] = v;
  }
  return request;
}

function finishReasonName(value) {
  if (!value || value === 'FINISH_REASON_UNSPECIFIED') return null;
  return String(value).replace(/^FINISH_REASON_/, '').toLowerCase();
}

function toUsage(u) {
  if (!u) return null;
  return {
    prompt_tokens: u.prompt_tokens,
    completion_tokens: u.completion_tokens,
    cached_prompt_tokens: u.cached_prompt_tokens,
  };
}

function toLogprobs(list) {
  return (list || []).map((lp) => ({
    token_id: lp.token_id, logprob: lp.logprob,
    top_token_ids: lp.top_token_ids, top_logprobs: lp.top_logprobs,
  }));
}

// A GenerateResponse or GenerateChunk as a plain object (finish_reason: "stop" | "length" |
// "abort" | null; usage null on every chunk but the last).
function toResult(m) {
  return {
    request_id: m.request_id,
    token_ids: m.token_ids,
    text: m.text,
    finish_reason: finishReasonName(m.finish_reason),
    stop_reason: m.stop_reason,
    usage: toUsage(m.usage),
    logprobs: toLogprobs(m.logprobs),
    engine_id: m.engine_id,
  };
}

// tlsCa: PEM file of the CA that verifies the server (TLS); tlsCert + tlsKey: PEM files of a
// client certificate for servers that require one (mTLS). No tlsCa: plaintext.
function channelCredentials(tlsCa, tlsCert, tlsKey) {
  if (!tlsCert !== !tlsKey) throw new TypeError('give tlsCert and tlsKey together');
  if (!tlsCa) {
    if (tlsCert) throw new TypeError('tlsCert needs tlsCa (the CA that verifies the server)');
    return grpc.credentials.createInsecure();
  }
  const read = (file) => (file ? fs.readFileSync(file) : null);
  return grpc.credentials.createSsl(read(tlsCa), read(tlsKey), read(tlsCert));
}

class Client {
  // target: "host:port". timeout: default deadline in seconds for every call (null: none);
  // a call's own `timeout` option overrides it. apiKey: sent as `authorization: Bearer KEY`
  // metadata on every call, for servers started with --api-key.
  constructor(target, {
    timeout = null, credentials = null, channelOptions = {}, tlsCa = null, tlsCert = null,
    tlsKey = null, apiKey = null,
  } = {}) {
    this.target = target;
    this.timeout = timeout;
    this.apiKey = apiKey;
    const creds = credentials || channelCredentials(tlsCa, tlsCert, tlsKey);
    this._generation = new v1.Generation(target, creds, channelOptions);
    this._engine = new v1.Engine(target, creds,
                                 { channelOverride: this._generation.getChannel() });
  }

  _metadata() {
    const metadata = new grpc.Metadata();
    if (this.apiKey) metadata.set('authorization', `Bearer ${this.apiKey}`);
    return metadata;
  }

  _callOptions(timeout) {
    const seconds = timeout ?? this.timeout;
    return seconds === null || seconds === undefined
      ? {} : { deadline: new Date(Date.now() + seconds * 1000) };
  }

  _unary(stub, method, request, timeout) {
    return new Promise((resolve, reject) => {
      stub[method](request, this._metadata(), this._callOptions(timeout), (err, response) => {
        if (err) reject(toNanoserveError(err));
        else resolve(response);
      });
    });
  }

  // Whole answer: {request_id, token_ids, text, finish_reason, stop_reason, usage, logprobs,
  // engine_id}.
  async generate(prompt, options = {}) {
    const request = buildRequest(prompt, options);
    return toResult(await this._unary(this._generation, 'Generate', request, options.timeout));
  }

  // Async iterator of chunks (same fields as generate's result, per chunk). Leaving the loop
  // early (break, return(), an exception) cancels the RPC so the server frees the request.
  stream(prompt, options = {}) {
    const request = buildRequest(prompt, options); // bad options throw here, not mid-loop
    return this._stream(request, this._callOptions(options.timeout));
  }

  async * _stream(request, callOptions) {
    const call = this._generation.Stream(request, this._metadata(), callOptions);
    call.on('error', () => {}); // the iterator below reports errors; a late CANCELLED must not crash
    try {
      for await (const chunk of call) yield toResult(chunk);
    } catch (err) {
      throw toNanoserveError(err);
    } finally {
      call.cancel();
    }
  }

  async modelInfo({ timeout } = {}) {
    return this._unary(this._engine, 'GetModelInfo', {}, timeout);
  }

  async load({ timeout } = {}) {
    return this._unary(this._engine, 'GetLoad', {}, timeout);
  }

  close() {
    this._generation.close();
  }
}

module.exports = {
  Client,
  buildRequest,
  NanoserveError,
  InvalidArgument,
  ResourceExhausted,
  Unavailable,
  DeadlineExceeded,
  Cancelled,
  SAMPLING_FIELDS,
  PROTO_ROOT,
};

// The official openai npm package (package-lock.json pins it) as a client of an edgegw:
//   node client.mjs BASE_URL MODEL
// asks a whole chat answer, a stream, the model list, a raw response's headers and a request
// the server refuses, and prints what it saw as one JSON object (tests/realworld/test_client_node.py
// checks it). Exits 0 once everything was asked, whatever the answers were.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });
const messages = [{ role: "user", content: "Name a colour." }];
const seen = {};

const whole = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 6 });
seen.whole = { text: whole.choices[0].message.content, finish: whole.choices[0].finish_reason, usage: whole.usage };

const stream = await client.chat.completions.create({
  model, messages, temperature: 0, max_tokens: 6, stream: true, stream_options: { include_usage: true },
});
let text = "";
let chunks = 0;
let finish = null;
for await (const chunk of stream) {
  for (const choice of chunk.choices) {
    text += choice.delta?.content ?? "";
    finish = choice.finish_reason ?? finish;
    chunks += 1;
  }
}
seen.stream = { text, chunks, finish };

const models = [];
for await (const m of client.models.list()) models.push(m.id);
seen.models = models;

const { data, response } = await client.chat.completions
  .create({ model, messages, temperature: 0, max_tokens: 2 })
  .withResponse();
seen.raw = {
  status: response.status,
  route: response.headers.get("x-edgegw-route"),
  serverTiming: response.headers.get("server-timing"),
  requestId: response.headers.get("x-request-id"),
  text: data.choices[0].message.content,
};

try {
  await client.chat.completions.create({ model, messages: [{ role: "user", content: "word ".repeat(700) }], max_tokens: 2 });
  seen.refused = null;
} catch (error) {
  seen.refused = { isAPIError: error instanceof OpenAI.APIError, status: error.status, code: error.code, message: error.message };
}

try {
  const cut = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "word ".repeat(700) }], max_tokens: 2, stream: true,
  });
  let events = 0;
  for await (const _ of cut) events += 1;
  seen.emptyStream = { raised: false, events };
} catch (error) {
  seen.emptyStream = { raised: true, isAPIError: error instanceof OpenAI.APIError, message: error.message };
}

process.stdout.write(JSON.stringify(seen) + "\n");

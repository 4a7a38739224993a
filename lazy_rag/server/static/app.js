// The lazy-rag page: ask over the served index through the OpenAI-compatible API (streamed),
// then show the sources, the TTFT and how many prompt tokens came from cached KV.
"use strict";

const $ = (id) => document.getElementById(id);
let model = null;

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

// /info needs the API key when the server has keys: asked again once one is typed in
async function loadInfo() {
  const res = await fetch("/info", { headers: authHeaders() });
  if (res.status === 401) {
    $("served").textContent = "this server needs an API key: enter it above";
    return;
  }
  if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
  const info = await res.json();
  model = info.model;
  $("mode").replaceChildren();
  for (const m of info.modes) {
    const opt = document.createElement("option");
    opt.value = opt.textContent = m;
    if (m === info.default_mode) opt.selected = true;
    $("mode").appendChild(opt);
  }
  $("served").textContent = info.index
    ? `${info.model} over ${info.index.chunks} indexed chunks (${info.device})`
    : `${info.model} (${info.device}); no index loaded: answers use no retrieval`;
  $("top-k").disabled = !info.index;
  $("ask").dataset.rag = info.index ? "1" : "";
}

function showSources(sources) {
  const body = $("sources").querySelector("tbody");
  body.replaceChildren();
  (sources || []).forEach((s, i) => {
    const tr = document.createElement("tr");
    for (const [value, cls] of [[i + 1], [s.score.toFixed(3)], [s.source], [s.text, "text"]]) {
      const td = document.createElement("td");
      td.textContent = value;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  });
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

async function ask(event) {
  event.preventDefault();
  $("answer").textContent = "";
  $("stats").textContent = "";
  $("error").hidden = true;
  showSources([]);
  $("send").disabled = true;
  const body = {
    model, stream: true, temperature: 0,
    max_tokens: Number($("max-tokens").value),
    mode: $("mode").value,
    messages: [{ role: "user", content: $("question").value }],
  };
  if ($("ask").dataset.rag) body.rag = { top_k: Number($("top-k").value) };
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() }, body: JSON.stringify(body),
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      showError(`${res.status}: ${(err.error && err.error.message) || res.statusText}`);
      return;
    }
    await readEvents(res.body.getReader());
  } catch (e) {
    showError(String(e));
  } finally {
    $("send").disabled = false;
  }
}

async function readEvents(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      handle(JSON.parse(data));
    }
  }
}

function handle(event) {
  if (event.error) { showError(event.error.message); return; }
  const choice = event.choices && event.choices[0];
  if (choice && choice.delta && choice.delta.content) $("answer").textContent += choice.delta.content;
  if (event.sources) showSources(event.sources);
  const s = event.lazy_rag;
  if (s) {
    $("stats").textContent = `TTFT ${s.ttft_ms.toFixed(0)} ms (${s.mode}${s.recovery ? "+" + s.recovery : ""}) · `
      + `prompt: ${s.cached_tokens} tokens from cached KV`
      + (s.encoded_tokens ? ` (${s.encoded_tokens} of them encoded now, cached for next time)` : "")
      + `, ${s.computed_tokens} computed`
      + (s.served_again ? ` · served again with ${s.recovery_applied} (reuse looked risky)` : "")
      + (s.reuse_risk !== null && s.reuse_risk !== undefined
        ? ` · reuse risk ${(100 * s.reuse_risk).toFixed(0)}%` : "");
  }
}

$("ask").addEventListener("submit", ask);
$("api-key").addEventListener("change", () => { if (!model) loadInfo().catch((e) => showError(String(e))); });
loadInfo().catch((e) => showError("Could not reach the server: " + e));

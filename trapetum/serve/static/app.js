// Trapetum web page: chat with streamed answers, and a side-by-side compare of two models.
// Plain browser JavaScript, no build step. Talks to the same OpenAI-compatible API as any client.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const state = { key: localStorage.getItem("trapetum.apiKey") || "", models: [], history: [], chatAbort: null,
                cmpAborts: [] };

// ------------------------------------------------------------------------------------------ API
function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

async function apiError(resp) {
  let msg = `HTTP ${resp.status}`;
  try { const j = await resp.json(); if (j.error && j.error.message) msg += ": " + j.error.message; } catch (_) {}
  if (resp.status === 401) msg += " (set the API key, top right)";
  return new Error(msg);
}

// Streams one chat completion. Callbacks: onStart() when the engine picks the request up,
// onDelta(text) per piece, onDone(lastUsageChunk) at the end. Resolves when the stream ends.
async function streamChat(body, signal, { onStart, onDelta, onDone, onAccepted }) {
  const resp = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), signal,
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
  });
  if (!resp.ok) throw await apiError(resp);
  if (onAccepted) onAccepted();
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "", usage = null, finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") { onDone(usage, finish); return; }
        const j = JSON.parse(data);
        if (j.error) throw new Error(j.error.message);
        if (j.usage) usage = j;
        const ch = j.choices && j.choices[0];
        if (!ch) continue;
        if (ch.delta && ch.delta.role) onStart();
        if (ch.delta && ch.delta.content) onDelta(ch.delta.content);
        if (ch.finish_reason) finish = ch.finish_reason;
      }
    }
  }
  onDone(usage, finish);
}

function settings() {
  const num = (id) => { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); };
  const s = { temperature: num("#set-temp"), top_p: num("#set-topp"), max_tokens: num("#set-max") };
  const seed = num("#set-seed");
  if (seed !== undefined) s.seed = Math.trunc(seed);
  return s;
}

// Live speed meter for one request: TTFT from engine start to first token, tok/s after it.
class Meter {
  constructor(show) { this.show = show; this.t0 = performance.now(); this.tStart = null; this.tFirst = null;
                      this.n = 0; this.timer = setInterval(() => this.render(), 200); this.final = null; }
  start() { if (this.tStart === null) this.tStart = performance.now(); this.render(); }
  token() { const now = performance.now(); if (this.tStart === null) this.tStart = now;
            if (this.tFirst === null) this.tFirst = now; this.n++; this.render(); }
  stop(usageChunk) {
    clearInterval(this.timer);
    if (usageChunk) this.final = usageChunk;
    this.render();
  }
  values() {
    const now = performance.now();
    const v = { queue: null, ttft: null, tps: null, n: this.n };
    if (this.tStart !== null) v.queue = (this.tStart - this.t0) / 1000;
    if (this.tFirst !== null) {
      v.ttft = (this.tFirst - this.tStart) / 1000;
      const dt = (now - this.tFirst) / 1000;
      if (this.n > 1 && dt > 0) v.tps = (this.n - 1) / dt;
    }
    if (this.final) {                                   // exact figures from the server
      const u = this.final.usage || {}, t = this.final.timings || {};
      if (u.completion_tokens !== undefined) v.n = u.completion_tokens;
      if (t.tokens_per_s) v.tps = t.tokens_per_s;
      if (t.ttft_s !== null && t.ttft_s !== undefined) v.ttft = t.ttft_s;
      if (t.queue_s !== null && t.queue_s !== undefined) v.queue = t.queue_s;
    }
    return v;
  }
  render() { this.show(this.values()); }
}

const fmt = {
  s: (x) => (x === null || x === undefined ? "–" : x < 1 ? `${Math.round(x * 1000)} ms` : `${x.toFixed(2)} s`),
  tps: (x) => (x === null || x === undefined ? "–" : x.toFixed(1)),
  n: (x) => (x === null || x === undefined ? "–" : String(x)),
};

// ------------------------------------------------------------------------------------------ models, health
async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw await apiError(r);
    state.models = (await r.json()).data;
  } catch (e) {
    state.models = [];
    $("#chat-info").innerHTML = "";
    addInfoRow($("#chat-info"), "error", e.message);
    return;
  }
  const fill = (sel, pick) => {
    const old = sel.value;
    sel.innerHTML = "";
    for (const m of state.models) sel.add(new Option(m.id, m.id));
    if (state.models.some((m) => m.id === old)) sel.value = old;
    else if (state.models[pick]) sel.value = state.models[pick].id;
  };
  fill($("#chat-model"), 0);
  fill($("#cmp-a .cmp-model"), 0);
  fill($("#cmp-b .cmp-model"), Math.min(1, state.models.length - 1));
  showInfo();
  showCmpInfo();
}

function addInfoRow(table, k, v) {
  const tr = table.insertRow();
  tr.insertCell().textContent = k;
  const td = tr.insertCell();
  if (v !== null && typeof v === "object") {           // nested (recipe, sizes, ...): folded
    const d = document.createElement("details"), s = document.createElement("summary"),
          pre = document.createElement("pre");
    s.textContent = Array.isArray(v) ? `${v.length} items` : `${Object.keys(v).length} fields`;
    pre.textContent = JSON.stringify(v, null, 1);
    d.append(s, pre);
    td.appendChild(d);
  } else if (/^(source|path)$/.test(k) && String(v).includes("/")) {
    td.textContent = String(v).split("/").pop(); td.title = v;
  } else td.textContent = v;
}

// One line per compare column: format, parameters, loaded weight size.
function summary(id) {
  const m = state.models.find((x) => x.id === id);
  if (!m || !m.info) return "";
  const i = m.info, parts = [];
  if (i.format) parts.push(i.format);
  if (i.family) parts.push(i.family);
  if (i.parameters) parts.push(human("parameters", i.parameters) + " params");
  if (i.memory_loaded_weights_bytes) parts.push(human("bytes", i.memory_loaded_weights_bytes) + " weights");
  if (i.context_size) parts.push(`ctx ${i.context_size}`);
  return parts.join(" · ");
}

function showCmpInfo() {
  for (const c of [$("#cmp-a"), $("#cmp-b")]) $(".cmp-info", c).textContent = summary($(".cmp-model", c).value);
}

function human(k, v) {
  if (typeof v === "number" && /bytes/.test(k)) {
    const u = ["B", "KiB", "MiB", "GiB"]; let i = 0;
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return `${v.toFixed(i ? 1 : 0)} ${u[i]}`;
  }
  if (typeof v === "number" && k === "parameters") return v >= 1e9 ? `${(v / 1e9).toFixed(2)} B` : `${(v / 1e6).toFixed(1)} M`;
  if (typeof v === "object" && v !== null) return Object.entries(v).map(([a, b]) => `${a}: ${typeof b === "object" ? JSON.stringify(b) : b}`).join(", ");
  return String(v);
}

function showInfo() {
  const t = $("#chat-info");
  t.innerHTML = "";
  const m = state.models.find((x) => x.id === $("#chat-model").value);
  if (!m) return;
  for (const [k, v] of Object.entries(m.info || {})) {
    const flat = v !== null && typeof v === "object" && Object.values(v).every((x) => typeof x !== "object");
    addInfoRow(t, k.replace(/_/g, " "), flat || typeof v !== "object" || v === null ? human(k, v) : v);
  }
}

async function pollHealth() {
  const el = $("#health");
  try {
    const r = await fetch("/health");
    const j = await r.json();
    let cls = j.status, text = j.status;
    if (j.status === "ok") {
      const run = j.engines.reduce((a, e) => a + e.running, 0), wait = j.engines.reduce((a, e) => a + e.waiting, 0);
      if (run || wait) { cls = "busy"; text = `busy: ${run} running, ${wait} queued`; } else text = "ready";
      if (!state.models.length) loadModels();
    }
    el.className = "health " + cls;
    el.textContent = text;
    el.title = j.error || "";
  } catch (e) {
    el.className = "health down";
    el.textContent = "offline";
  }
}

// ------------------------------------------------------------------------------------------ chat
function bubble(role, text) {
  $("#chat-empty")?.remove();
  const d = document.createElement("div");
  d.className = `msg ${role}`;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = text;
  d.appendChild(body);
  $("#messages").appendChild(d);
  d.scrollIntoView({ block: "end" });
  return d;
}

function showChatStats(v) {
  $("#chat-ttft").textContent = fmt.s(v.ttft);
  $("#chat-tps").textContent = fmt.tps(v.tps);
  $("#chat-ntok").textContent = fmt.n(v.n);
  $("#chat-queue").textContent = fmt.s(v.queue);
}

async function sendChat(ev) {
  ev?.preventDefault();
  const text = $("#chat-input").value.trim();
  if (!text || state.chatAbort) return;
  $("#chat-input").value = "";
  bubble("user", text);
  state.history.push({ role: "user", content: text });
  const sys = $("#set-system").value.trim();
  const messages = (sys ? [{ role: "system", content: sys }] : []).concat(state.history);
  const out = bubble("assistant streaming", "");
  const body = $(".body", out);
  const meter = new Meter(showChatStats);
  const ctl = new AbortController();
  state.chatAbort = ctl;
  $("#chat-send").disabled = true; $("#chat-stop").disabled = false;
  let answer = "", finish = null;
  try {
    await streamChat({ model: $("#chat-model").value, messages, ...settings() }, ctl.signal, {
      onStart: () => { meter.start(); pollHealth(); },
      onDelta: (t) => { answer += t; body.textContent = answer; meter.token(); out.scrollIntoView({ block: "end" }); },
      onDone: (u, f) => { meter.stop(u); finish = f; },
    });
  } catch (e) {
    meter.stop(null);
    if (e.name === "AbortError") finish = "stopped";
    else { out.classList.add("error"); body.textContent = answer + (answer ? "\n" : "") + e.message; }
  }
  out.classList.remove("streaming");
  const v = meter.values();
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = `${fmt.n(v.n)} tokens · ${fmt.tps(v.tps)} tok/s · TTFT ${fmt.s(v.ttft)}` +
                     (v.queue > 0.05 ? ` · queued ${fmt.s(v.queue)}` : "") + (finish ? ` · ${finish}` : "");
  out.appendChild(meta);
  if (answer) state.history.push({ role: "assistant", content: answer });
  else if (!out.classList.contains("error")) state.history.pop();
  state.chatAbort = null;
  pollHealth();
  $("#chat-send").disabled = false; $("#chat-stop").disabled = true;
  $("#chat-input").focus();
}

// ------------------------------------------------------------------------------------------ compare
async function runColumn(col, prompt, signal, accepted = () => {}) {
  const out = $(".out", col), st = $(".state", col);
  out.textContent = ""; out.classList.remove("error");
  st.textContent = "queued"; st.className = "state queued";
  const show = (v) => {
    $(".ttft", col).textContent = fmt.s(v.ttft);
    $(".tps", col).textContent = fmt.tps(v.tps);
    $(".ntok", col).textContent = fmt.n(v.n);
    $(".queue", col).textContent = fmt.s(v.queue);
    col.dataset.tps = v.tps || 0;
    updateBars();
  };
  const meter = new Meter(show);
  let text = "";
  try {
    await streamChat({ model: $(".cmp-model", col).value, messages: [{ role: "user", content: prompt }], ...settings() },
      signal, {
        onAccepted: accepted,
        onStart: () => { meter.start(); pollHealth(); st.textContent = "prefill"; st.className = "state streaming"; },
        onDelta: (t) => { text += t; out.textContent = text; meter.token(); st.textContent = "streaming";
                          out.scrollTop = out.scrollHeight; },
        onDone: (u, f) => { meter.stop(u); pollHealth(); st.textContent = f === "length" ? "done (length)" : "done";
                            st.className = "state done"; },
      });
  } catch (e) {
    accepted();
    meter.stop(null);
    if (e.name === "AbortError") { st.textContent = "stopped"; st.className = "state"; }
    else { st.textContent = "error"; st.className = "state error"; out.classList.add("error");
           out.textContent = text + (text ? "\n" : "") + e.message; }
  }
}

function updateBars() {
  const cols = [$("#cmp-a"), $("#cmp-b")];
  const best = Math.max(1e-9, ...cols.map((c) => Number(c.dataset.tps || 0)));
  for (const c of cols) $(".speedbar .fill", c).style.width = `${(100 * Number(c.dataset.tps || 0)) / best}%`;
}

async function sendCompare(ev) {
  ev?.preventDefault();
  const prompt = $("#cmp-input").value.trim();
  if (!prompt || state.cmpAborts.length) return;
  $("#cmp-send").disabled = true; $("#cmp-stop").disabled = false;
  const cols = [$("#cmp-a"), $("#cmp-b")];
  for (const c of cols) c.dataset.tps = 0;
  state.cmpAborts = cols.map(() => new AbortController());
  // A is queued before B, so on a shared engine the left column runs first.
  let acceptedA;
  const gate = new Promise((res) => { acceptedA = res; });
  const a = runColumn(cols[0], prompt, state.cmpAborts[0].signal, acceptedA);
  await gate;
  const b = runColumn(cols[1], prompt, state.cmpAborts[1].signal);
  await Promise.all([a, b]);
  pollHealth();
  state.cmpAborts = [];
  $("#cmp-send").disabled = false; $("#cmp-stop").disabled = true;
}

// ------------------------------------------------------------------------------------------ wiring
function showView(name) {
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.view === name);
  for (const v of document.querySelectorAll(".view")) v.classList.toggle("active", v.id === `view-${name}`);
  location.hash = name;
}

document.addEventListener("DOMContentLoaded", () => {
  for (const t of document.querySelectorAll(".tab")) t.addEventListener("click", () => showView(t.dataset.view));
  if (location.hash === "#compare") showView("compare");
  $("#chat-form").addEventListener("submit", sendChat);
  $("#chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); sendChat(); }
  });
  $("#chat-stop").addEventListener("click", () => state.chatAbort?.abort());
  $("#chat-clear").addEventListener("click", () => {
    state.history = [];
    $("#messages").innerHTML = '<div class="empty" id="chat-empty">New conversation.</div>';
  });
  $("#chat-model").addEventListener("change", showInfo);
  for (const sel of document.querySelectorAll(".cmp-model")) sel.addEventListener("change", showCmpInfo);
  $("#cmp-form").addEventListener("submit", sendCompare);
  $("#cmp-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); sendCompare(); }
  });
  $("#cmp-stop").addEventListener("click", () => state.cmpAborts.forEach((c) => c.abort()));
  $("#key-btn").addEventListener("click", () => { $("#key-input").value = state.key; $("#key-dialog").showModal(); });
  $("#key-dialog").addEventListener("close", () => {
    if ($("#key-dialog").returnValue !== "ok") return;
    state.key = $("#key-input").value.trim();
    localStorage.setItem("trapetum.apiKey", state.key);
    loadModels();
  });
  pollHealth();
  loadModels();
  setInterval(pollHealth, 2000);
});

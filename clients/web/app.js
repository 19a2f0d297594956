// unmask visualizer: streams a chat completion with stream_options.include_denoising and draws every step.
// Relative URLs only (resolved against <base href>), so the page works behind a reverse proxy under a prefix.
"use strict";
const $ = (id) => document.getElementById(id);
const PALETTE = ["#5fafff", "#5fd7ff", "#5fffd7", "#87ff87", "#d7ff5f", "#ffd75f", "#ffaf5f", "#ff875f", "#ff5f87",
  "#d75fff", "#af87ff", "#8787ff"];
const state = { messages: [], frames: [], controller: null, model: null };

function key() { return $("apikey").value.trim(); }
function headers() {
  const h = { "Content-Type": "application/json" };
  if (key()) h["Authorization"] = "Bearer " + key();
  return h;
}
function showError(msg) { const e = $("error"); e.textContent = msg; e.hidden = !msg; }

async function errorText(resp) {
  try { const b = await resp.json(); return (b.error && b.error.message) || JSON.stringify(b); }
  catch (_) { return resp.statusText; }
}

async function loadModels() {
  showError("");
  let resp;
  try { resp = await fetch("v1/models", { headers: headers() }); }
  catch (e) { showError("cannot reach the server: " + e); return; }
  if (resp.status === 401) {   // the key field shows only on a server that needs one
    $("keybox").hidden = false; showError("this server needs an API key: enter it above"); $("apikey").focus(); return;
  }
  if (resp.ok && !key()) $("keybox").hidden = true;
  if (!resp.ok) { showError("GET v1/models: " + resp.status + " " + await errorText(resp)); return; }
  const body = await resp.json();
  const sel = $("model"); sel.innerHTML = "";
  for (const m of body.data) { const o = document.createElement("option"); o.textContent = m.id; sel.appendChild(o); }
}

function options() {
  const o = {};
  for (const id of ["max_tokens", "steps", "block_size"]) { const v = $(id).value; if (v !== "") o[id] = parseInt(v, 10); }
  for (const id of ["threshold", "temperature", "cfg_scale"]) { const v = $(id).value; if (v !== "") o[id] = parseFloat(v); }
  if ($("remasking").value) o.remasking = $("remasking").value;
  if ($("speculative").value) o.speculative = $("speculative").value === "true";
  const extra = $("extra").value.trim();
  if (extra) Object.assign(o, JSON.parse(extra));   // any other request field, e.g. {"seed": 1}
  return o;
}

function addMessage(role, text) {
  const d = document.createElement("div"); d.className = "msg " + role; d.textContent = text;
  $("history").appendChild(d); return d;
}

// ---------------------------------------------------------------- canvas state -> frames
function newCanvas(blockSize) {
  return { cells: [], stepOf: [], blockOf: [], step: -1, block: 0, nfe: 0, revealed: 0, fresh: [], blockSize,
           t0: performance.now() };
}
function update(c, d) {
  const n = (d.canvas || []).length;
  while (c.cells.length < n) { c.cells.push(null); c.stepOf.push(null); c.blockOf.push(null); }
  c.step = d.step; c.block = d.block; c.nfe = d.nfe; c.fresh = [];
  c.final = Number.isInteger(d.final) ? d.final : null;   // revisable canvases: positions >= final may change
  for (const r of d.revealed || []) { c.fresh.push(r.position); }
  d.canvas.forEach((t, p) => {
    c.cells[p] = t;
    if (t !== null && c.stepOf[p] === null) { c.stepOf[p] = d.step; c.blockOf[p] = d.block; c.revealed++; }
  });
}
function span(c) {
  let start = 0, prevEnd = null;
  c.blockOf.forEach((b, p) => { if (b !== null && b < c.block) start = Math.max(start, p + 1); });
  let size = c.blockSize;
  if (!size && c.block > 0) {
    const prev = []; c.blockOf.forEach((b, p) => { if (b === c.block - 1) prev.push(p); });
    if (prev.length) size = Math.max(...prev) + 1 - Math.min(...prev);
  }
  if (!size) { const mine = []; c.blockOf.forEach((b, p) => { if (b === c.block) mine.push(p); });
    return mine.length ? [start, Math.max(...mine) + 1] : null; }
  return [start, Math.min(c.cells.length, start + size)];
}
function snapshot(c) {
  const secs = (performance.now() - c.t0) / 1000;
  return { cells: c.cells.slice(), stepOf: c.stepOf.slice(), blockOf: c.blockOf.slice(), fresh: c.fresh.slice(),
           step: c.step, block: c.block, nfe: c.nfe, revealed: c.revealed, span: span(c), final: c.final ?? null,
           tps: secs > 0 ? c.revealed / secs : 0 };
}

// the positions after the last revealed one, which a finished answer (an EOS before max_tokens) never decodes
function dropUnrevealedTail(f) {
  let n = f.cells.length;
  while (n > 0 && f.cells[n - 1] === null) n--;
  f.cells = f.cells.slice(0, n); f.stepOf = f.stepOf.slice(0, n); f.blockOf = f.blockOf.slice(0, n);
  if (f.span) f.span = [Math.min(f.span[0], n), Math.min(f.span[1], n)];
}

function draw(f) {
  const root = $("canvas"); root.innerHTML = "";
  const fresh = new Set(f.fresh);
  const bounds = new Set();   // a block starts after the last position of the earlier blocks
  const blocks = [...new Set(f.blockOf.filter((b) => b !== null))].sort((a, b) => a - b);
  for (const b of blocks.slice(1)) {
    let end = -1; f.blockOf.forEach((x, p) => { if (x !== null && x < b) end = Math.max(end, p); });
    if (end >= 0) bounds.add(end + 1);
  }
  if (f.span && f.span[0] > 0) bounds.add(f.span[0]);
  f.cells.forEach((t, p) => {
    if (bounds.has(p)) { const s = document.createElement("span"); s.className = "bound"; root.appendChild(s); }
    const s = document.createElement("span");
    const cur = f.span && p >= f.span[0] && p < f.span[1];
    if (t === null) { s.className = "mask" + (cur ? " cur" : ""); }
    else {
      const prov = f.final !== null && f.final !== undefined && p >= f.final;   // may still change
      s.className = "tok" + (cur ? " cur" : "") + (fresh.has(p) ? " fresh" : "") + (prov ? " prov" : "");
      s.textContent = t.replace(/\n/g, "↵") || "∅";
      s.style.color = PALETTE[(f.stepOf[p] || 0) % PALETTE.length];
      s.title = "position " + p + ", revealed at step " + (f.stepOf[p] + 1) + " (block " + (f.blockOf[p] + 1) + ")";
    }
    s.dataset.pos = p; root.appendChild(s);
  });
  $("c-step").textContent = "step " + (f.step + 1) + " · block " + (f.block + 1);   // both counted from 1
  $("c-nfe").textContent = "NFE " + f.nfe;
  $("c-tpf").textContent = "TPF " + (f.nfe ? (f.revealed / f.nfe).toFixed(2) : "–");
  $("c-tps").textContent = f.tps.toFixed(1) + " tok/s";
}

function showFrame(i) {
  const f = state.frames[i]; if (!f) return;
  draw(f);
  $("slider-label").textContent = "step " + (i + 1) + " of " + state.frames.length;
}

// ---------------------------------------------------------------- SSE over fetch
async function* sseData(resp) {
  const reader = resp.body.getReader(); const dec = new TextDecoder(); let buf = "";
  while (true) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i).replace(/\r$/, ""); buf = buf.slice(i + 1);
      if (line.startsWith("data:")) yield line.slice(5).trim();
    }
  }
}

async function post(body) {
  return fetch("v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                        signal: state.controller.signal });
}

async function send(question) {
  showError("");
  const model = $("model").value;
  if (!model) { await loadModels(); if (!$("model").value) return; }
  let opts;
  try { opts = options(); } catch (e) { showError("other fields: not a JSON object (" + e.message + ")"); return; }
  state.messages.push({ role: "user", content: question });
  addMessage("user", question);
  const out = addMessage("assistant", "…");
  const body = { model: $("model").value, messages: state.messages, stream: true, ...opts,
                 stream_options: { include_usage: true, include_denoising: true } };
  state.controller = new AbortController(); state.frames = [];
  $("send").disabled = true; $("stop").disabled = false;
  $("slider").disabled = true; $("c-usage").textContent = "";
  const c = newCanvas(opts.block_size || null);
  let text = "", ok = false, stopped = false;
  try {
    let resp = await post(body);
    if (resp.status === 400) {
      const msg = await errorText(resp);
      if (/include_denoising|stream_options/.test(msg)) {   // a plain OpenAI-compatible server: retry once
        delete body.stream_options.include_denoising; showError("no denoising stream from this server: " + msg);
        resp = await post(body);
      } else { throw new Error("400: " + msg); }
    }
    if (resp.status === 401) { $("apikey").focus(); throw new Error("the server needs a (valid) API key: enter it above"); }
    if (!resp.ok) throw new Error(resp.status + ": " + await errorText(resp));
    for await (const data of sseData(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error("server error: " + chunk.error.message);
      if (chunk.denoising && chunk.denoising.index === 0) {
        update(c, chunk.denoising); const f = snapshot(c); state.frames.push(f); draw(f);
        $("slider-label").textContent = "step " + state.frames.length;
      }
      for (const ch of chunk.choices || []) {
        if (ch.index === 0 && ch.delta && ch.delta.content) { text += ch.delta.content; out.textContent = text; }
      }
      if (chunk.usage) {
        const u = chunk.usage;
        $("c-usage").textContent = "usage: " + u.prompt_tokens + " prompt + " + u.completion_tokens +
          " completion tokens" + (u.nfe ? ", NFE " + u.nfe + ", TPF " + (u.completion_tokens / u.nfe).toFixed(2) : "");
      }
    }
    ok = true;
  } catch (e) {
    if (e.name === "AbortError") { stopped = true; showError("stopped"); } else { showError(String(e.message || e)); }
  } finally {
    state.controller = null; $("send").disabled = false; $("stop").disabled = true;
  }
  if (ok) { state.messages.push({ role: "assistant", content: text }); out.textContent = text || "(empty)"; }
  else { state.messages.pop(); out.textContent = text + (stopped ? " (stopped)" : " (failed: see the error)"); }
  if (state.frames.length) {
    const last = state.frames[state.frames.length - 1]; last.fresh = [];
    if (ok) dropUnrevealedTail(last);   // after an early EOS nothing will fill the rest of the canvas
    const s = $("slider"); s.max = String(state.frames.length - 1); s.value = s.max; s.disabled = false;
    showFrame(state.frames.length - 1);
  }
  document.body.dataset.done = String(Number(document.body.dataset.done || 0) + 1);
}

$("ask").addEventListener("submit", (ev) => {
  ev.preventDefault(); const q = $("prompt").value.trim(); if (!q || state.controller) return;
  $("prompt").value = ""; send(q);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
function clearView() {
  state.frames = []; $("canvas").innerHTML = ""; $("c-usage").textContent = ""; showError("");
  $("c-step").textContent = "step –"; $("c-nfe").textContent = "NFE –"; $("c-tpf").textContent = "TPF –";
  $("c-tps").textContent = "– tok/s";
  const s = $("slider"); s.max = "0"; s.value = "0"; s.disabled = true; $("slider-label").textContent = "no answer yet";
}
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = []; $("history").innerHTML = ""; clearView();
});
$("slider").addEventListener("input", (ev) => showFrame(parseInt(ev.target.value, 10)));
$("apikey").addEventListener("change", loadModels);
for (const [i, colour] of PALETTE.entries()) {   // the legend shows the colours the canvas uses
  const sw = document.createElement("span"); sw.style.background = colour; sw.title = "step " + (i + 1);
  $("swatches").appendChild(sw);
}
loadModels();

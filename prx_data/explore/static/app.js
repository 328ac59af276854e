// prx-data explorer. Table text (captions, ids, labels) only ever goes into the
// page through textContent / attribute setters, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { meta: null, labels: {}, fields: [], timer: null, seq: 0, offset: 0, next: null };

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  return e;
}

function params(extra) {
  const p = new URLSearchParams();
  const q = $("q").value.trim();
  if (q) p.set("q", q);
  if ($("tier").value) p.set("tier", $("tier").value);
  if ($("aspect").value) p.set("aspect", $("aspect").value);
  if ($("quality").value) p.set("quality", $("quality").value);
  for (const col of Object.keys(state.labels)) {
    const v = $("label-" + col).value;
    if (v) p.set("label." + col, v);
  }
  for (const col of state.fields) {
    const v = $("field-" + col).value.trim();
    if (v) p.set("field." + col, v);
  }
  const score = $("score").value;
  if (score) {
    if ($("score-min").value.trim()) p.set("min." + score, $("score-min").value.trim());
    if ($("score-max").value.trim()) p.set("max." + score, $("score-max").value.trim());
    if ($("sort").value) { p.set("sort", score); p.set("order", $("sort").value); }
  }
  for (const [k, v] of Object.entries(extra || {})) p.set(k, v);
  return p;
}

function option(select, value, text) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = text;
  select.appendChild(o);
}

// Show the keeper of a duplicate: an exact id search (also a plain link that works on its own).
function showId(id) {
  for (const col of state.fields) $("field-" + col).value = "";
  $("q").value = id;
  runSearch(0);
}

function captionTabs(item) {
  const box = el("div", "captions");
  const names = Object.keys(item.captions || {});
  if (!names.length) return box;
  const tabs = el("div", "tabs");
  const text = el("p", "caption");
  const show = (name) => {
    const v = item.captions[name];
    text.textContent = v == null ? "" : v;
    text.dataset.column = name;
    text.classList.toggle("empty", v == null || v === "");
    if (v == null || v === "") text.textContent = "(no " + name + ")";
    for (const b of tabs.children) b.classList.toggle("on", b.dataset.column === name);
  };
  for (const name of names) {
    const b = el("button", "tab", name);
    b.type = "button";
    b.dataset.column = name;
    b.addEventListener("click", (e) => { e.stopPropagation(); show(name); });
    tabs.appendChild(b);
  }
  if (names.length > 1) box.appendChild(tabs);
  box.appendChild(text);
  show(names[0]);
  return box;
}

// Thumbnails load at most THUMB_SLOTS at a time: the browser has six connections per host,
// and a page of thumbnails must never hold all of them while the next search waits.
const THUMB_SLOTS = 4;
const thumbs = { queue: [], busy: 0, generation: 0 };

function queueThumb(img, id) {
  thumbs.queue.push({ img, id, generation: thumbs.generation });
  pumpThumbs();
}

function pumpThumbs() {
  while (thumbs.busy < THUMB_SLOTS && thumbs.queue.length) {
    const job = thumbs.queue.shift();
    if (job.generation !== thumbs.generation && !job.img.isConnected) continue;
    thumbs.busy++;
    const done = () => { thumbs.busy--; pumpThumbs(); };
    job.img.addEventListener("load", done, { once: true });
    job.img.addEventListener("error", done, { once: true });
    job.img.src = "/api/thumb?id=" + encodeURIComponent(job.id);
  }
}

// Called before a grid is replaced: queued thumbnails of cards no longer shown are dropped.
function newThumbGeneration() {
  thumbs.generation++;
}

function card(item, onClick) {
  const fig = el("figure", "card");
  fig.dataset.id = item.id;
  const img = document.createElement("img");
  img.alt = "";
  queueThumb(img, item.id);
  const cap = document.createElement("figcaption");
  cap.appendChild(el("code", "rid", item.id));
  const dims = el("span", "dims",
    (item.width && item.height) ? item.width + "\u00d7" + item.height : "unreadable");
  cap.appendChild(dims);
  if (item.low_information) cap.appendChild(el("span", "badge blank", "blank"));
  const chips = el("div", "chips");
  for (const [k, v] of Object.entries(item.labels || {})) chips.appendChild(el("span", "chip", k + ": " + v));
  const score = $("score").value;
  if (score && item.scores && item.scores[score] != null) {
    chips.appendChild(el("span", "chip score", score + ": " + Number(item.scores[score]).toPrecision(3)));
  }
  if (item.cosine != null) chips.appendChild(el("span", "chip score", "cosine " + item.cosine.toFixed(3)));
  if (item.kept) chips.appendChild(el("span", "badge kept", "kept"));
  if (chips.children.length) cap.appendChild(chips);
  if (item.dup_of != null) {
    const d = el("div", "dup", "duplicate of ");
    const a = el("a", "keeper", item.dup_of);
    a.href = "/?q=" + encodeURIComponent(item.dup_of);
    a.addEventListener("click", (e) => { e.preventDefault(); e.stopPropagation(); showId(item.dup_of); });
    d.appendChild(a);
    cap.appendChild(d);
  }
  cap.appendChild(captionTabs(item));
  fig.append(img, cap);
  fig.addEventListener("click", () => onClick(item));
  return fig;
}

async function getJSON(url) {
  const r = await fetch(url);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

async function runSearch(offset) {
  const seq = ++state.seq;
  offset = offset || 0;
  $("status").textContent = "searching\u2026";
  const p = params(offset ? { offset: String(offset) } : {});
  history.replaceState(null, "", "?" + params());
  try {
    const data = await getJSON("/api/search?" + p);
    if (seq !== state.seq) return; // a newer query is on its way
    const grid = $("results");
    newThumbGeneration();
    grid.replaceChildren(...data.results.map((it) => card(it, showSimilar)));
    grid.dataset.query = data.query;
    grid.dataset.offset = String(data.offset);
    state.offset = data.offset;
    state.next = data.next_offset;
    const n = data.results.length;
    const span = n ? (data.offset + 1) + "\u2013" + (data.offset + n) : "0";
    $("status").textContent = n + (n === 1 ? " image (" : " images (") + data.mode + "), " + span;
    $("prev").disabled = data.offset === 0;
    $("next").disabled = data.next_offset == null;
    $("page").textContent = n ? "images " + span : "no images";
  } catch (e) {
    $("status").textContent = "error: " + e.message;
  }
}

async function showSimilar(item) {
  for (const e of document.querySelectorAll("figure.card.active")) e.classList.remove("active");
  for (const e of document.querySelectorAll("figure.card")) {
    if (e.dataset.id === item.id) e.classList.add("active");
  }
  $("similar-panel").hidden = false;
  $("selected-id").textContent = item.id;
  state.selected = item;
  $("show-cluster").hidden = !state.meta.cluster_column;
  $("cluster-head").hidden = true;
  $("cluster").replaceChildren();
  $("selected").textContent = item.caption == null ? "" : item.caption;
  const panel = $("neighbours");
  panel.dataset.for = "";
  panel.replaceChildren();
  const p = params({ id: item.id });
  p.delete("q");
  try {
    const data = await getJSON("/api/similar?" + p);
    panel.replaceChildren(...data.results.map((it) => card(it, showSimilar)));
    panel.dataset.for = item.id;
    if (data.error) $("selected").textContent += " (" + data.error + ")";
  } catch (e) {
    $("selected").textContent = "error: " + e.message;
  }
}

// Near duplicates side by side: the neighbours semantic dedup would merge, the kept one marked.
async function showCluster() {
  const item = state.selected;
  if (!item) return;
  const strip = $("cluster");
  strip.dataset.for = "";
  strip.replaceChildren();
  const head = $("cluster-head");
  head.hidden = false;
  head.textContent = "loading near duplicates\u2026";
  try {
    const data = await getJSON("/api/cluster?" + new URLSearchParams({ id: item.id }));
    for (const m of data.members) m.kept = m.id === data.keeper;
    strip.replaceChildren(...data.members.map((it) => card(it, showSimilar)));
    strip.dataset.for = item.id;
    head.textContent = data.error ? data.error
      : data.members.length + " image(s) at cosine \u2265 " + data.cosine + " on " + data.column
        + "; semantic dedup keeps " + data.keeper;
  } catch (e) {
    head.textContent = "error: " + e.message;
  }
}

function later() {
  clearTimeout(state.timer);
  state.timer = setTimeout(() => runSearch(0), 250);
}

async function init() {
  const meta = await getJSON("/api/meta");
  state.meta = meta;
  $("table-info").textContent = meta.table + " \u00b7 " + meta.rows.toLocaleString() + " rows";
  $("q").placeholder = "search " + (meta.text_columns.join(", ") || "ids") + ", or an exact id\u2026";
  for (const t of meta.tiers) option($("tier"), t, t);
  for (const a of meta.aspects) option($("aspect"), a, a);
  const qnames = { low: "low-information", ok: "not low-information", unmeasured: "not measured" };
  for (const v of meta.quality) option($("quality"), v, qnames[v] || v);
  $("quality-filter").hidden = !meta.quality.length;
  for (const c of meta.scores) option($("score"), c, c);
  $("score-filter").hidden = !meta.scores.length;
  state.labels = meta.labels;
  for (const [col, values] of Object.entries(meta.labels)) {
    const label = el("label", null, col + " ");
    const sel = document.createElement("select");
    sel.id = "label-" + col;
    option(sel, "", "any");
    for (const v of values) option(sel, v, v);
    sel.addEventListener("change", () => runSearch(0));
    label.appendChild(sel);
    $("labels").appendChild(label);
  }
  state.fields = meta.fields;
  for (const col of meta.fields) {
    const label = el("label", null, (col === "id" ? "id starts with" : col) + " ");
    const input = document.createElement("input");
    input.type = "search";
    input.id = "field-" + col;
    input.className = "field";
    input.autocomplete = "off";
    input.setAttribute("aria-label", col + " filter");
    input.addEventListener("input", later);
    label.appendChild(input);
    $("fields").appendChild(label);
  }
  // Restore a shared or reloaded view from the address bar.
  const url = new URLSearchParams(location.search);
  if (url.get("q")) $("q").value = url.get("q");
  for (const [k, v] of url.entries()) {
    if (k === "sort") $("score").value = v;
    if (k === "order") $("sort").value = v;
    if (k.startsWith("min.") || k.startsWith("max.")) {
      $("score").value = k.slice(4);
      $(k.startsWith("min.") ? "score-min" : "score-max").value = v;
    }
    const target = k.startsWith("label.") ? $("label-" + k.slice(6))
      : k.startsWith("field.") ? $("field-" + k.slice(6))
        : ["tier", "aspect", "quality"].includes(k) ? $(k) : null;
    if (target) target.value = v;
  }
  $("q").addEventListener("input", later);
  for (const id of ["tier", "aspect", "quality", "score", "sort"]) $(id).addEventListener("change", () => runSearch(0));
  for (const id of ["score-min", "score-max"]) $(id).addEventListener("input", later);
  $("show-cluster").addEventListener("click", showCluster);
  $("prev").addEventListener("click", () => runSearch(Math.max(0, state.offset - meta.page_size)));
  $("next").addEventListener("click", () => { if (state.next != null) runSearch(state.next); });
  $("close-similar").addEventListener("click", () => { $("similar-panel").hidden = true; });
  document.body.dataset.ready = "1";
  await runSearch(0);
}

init();

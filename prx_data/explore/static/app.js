// prx-data explorer. Table text (captions, ids, labels) only ever goes into the
// page through textContent / attribute setters, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { labels: {}, timer: null, seq: 0 };

function params(extra) {
  const p = new URLSearchParams();
  const q = $("q").value.trim();
  if (q) p.set("q", q);
  if ($("tier").value) p.set("tier", $("tier").value);
  if ($("aspect").value) p.set("aspect", $("aspect").value);
  for (const col of Object.keys(state.labels)) {
    const v = $("label-" + col).value;
    if (v) p.set("label." + col, v);
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

function card(item, onClick) {
  const fig = document.createElement("figure");
  fig.className = "card";
  fig.dataset.id = item.id;
  const img = document.createElement("img");
  img.loading = "lazy";
  img.alt = "";
  img.src = "/api/thumb?id=" + encodeURIComponent(item.id);
  const cap = document.createElement("figcaption");
  const dims = document.createElement("span");
  dims.className = "dims";
  dims.textContent = (item.width && item.height) ? item.width + "\u00d7" + item.height : "unreadable";
  const text = document.createElement("span");
  text.className = "caption";
  text.textContent = item.caption == null ? "" : item.caption;
  cap.append(dims, text);
  fig.append(img, cap);
  fig.title = item.id;
  fig.addEventListener("click", () => onClick(item));
  return fig;
}

async function getJSON(url) {
  const r = await fetch(url);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

async function runSearch() {
  const seq = ++state.seq;
  $("status").textContent = "searching…";
  try {
    const data = await getJSON("/api/search?" + params());
    if (seq !== state.seq) return; // a newer query is on its way
    const grid = $("results");
    grid.replaceChildren(...data.results.map((it) => card(it, showSimilar)));
    grid.dataset.query = data.query;
    $("status").textContent = data.results.length + " images (" + data.mode + ")";
  } catch (e) {
    $("status").textContent = "error: " + e.message;
  }
}

async function showSimilar(item) {
  for (const el of document.querySelectorAll("figure.card.active")) el.classList.remove("active");
  for (const el of document.querySelectorAll("figure.card")) {
    if (el.dataset.id === item.id) el.classList.add("active");
  }
  $("similar-panel").hidden = false;
  $("selected-id").textContent = item.id;
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

async function init() {
  const meta = await getJSON("/api/meta");
  $("table-info").textContent = meta.table + " \u00b7 " + meta.rows.toLocaleString() + " rows";
  for (const t of meta.tiers) option($("tier"), t, t);
  for (const a of meta.aspects) option($("aspect"), a, a);
  state.labels = meta.labels;
  for (const [col, values] of Object.entries(meta.labels)) {
    const label = document.createElement("label");
    label.textContent = col + " ";
    const sel = document.createElement("select");
    sel.id = "label-" + col;
    option(sel, "", "any");
    for (const v of values) option(sel, v, v);
    sel.addEventListener("change", runSearch);
    label.appendChild(sel);
    $("labels").appendChild(label);
  }
  $("q").addEventListener("input", () => {
    clearTimeout(state.timer);
    state.timer = setTimeout(runSearch, 200);
  });
  $("tier").addEventListener("change", runSearch);
  $("aspect").addEventListener("change", runSearch);
  $("close-similar").addEventListener("click", () => { $("similar-panel").hidden = true; });
  document.body.dataset.ready = "1";
  await runSearch();
}

init();

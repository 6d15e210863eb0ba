// fusionp2p dashboard: polls /api/status every 2 s and redraws. Plain DOM and SVG, no library.
// Every string that came from the swarm (peer ids, job ids, device names, reasons) goes into the
// page through textContent or an attribute, never through innerHTML.
"use strict";

const POLL_MS = 2000;
const SVGNS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const k of kids) if (k != null) e.append(k);
  return e;
}

function sv(tag, attrs, ...kids) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") e.textContent = v; else e.setAttribute(k, String(v));
  }
  for (const k of kids) if (k != null) e.append(k);
  return e;
}

const short = (p) => (p && p.length > 10 ? "…" + p.slice(-8) : p || "");

function bytes(n) {
  if (n == null) return "–";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (i ? n.toFixed(n < 10 ? 2 : 1) : n.toFixed(0)) + " " + u[i];
}
const rate = (n) => (n == null ? "–" : bytes(n) + "/s");
const num = (n, d = 3) => (n == null ? "–" : Number(n).toFixed(d));
const secs = (s) => (s == null ? "–" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(1) + " s");

function card(k, v) { return el("div", { class: "card" }, el("div", { class: "v", text: v }), el("div", { class: "k", text: k })); }

function renderSummary(s) {
  const t = s.traffic_totals || {};
  const ctl = t.control || { sent: 0, received: 0 };
  const dat = t.data || { sent: 0, received: 0 };
  const running = (s.jobs_by_state || {}).running || 0;
  const box = document.getElementById("summary");
  box.replaceChildren(
    card("nodes alive", String((s.alive_by_role || {}).node || 0)),
    card("bootstraps alive", String((s.alive_by_role || {}).bootstrap || 0)),
    card("dead", String(s.dead || 0)),
    card("jobs seen · running here", `${s.jobs.length} · ${running}`),
    card("control plane ↑/↓", `${bytes(ctl.sent)} / ${bytes(ctl.received)}`),
    card("data plane ↑/↓", `${bytes(dat.sent)} / ${bytes(dat.received)}`),
    card("refused messages", s.refusals ? String(s.refusals.total) : "–"),
  );
}

function renderMembers(s) {
  const traffic = {};
  for (const t of s.traffic) {
    const x = traffic[t.peer] || (traffic[t.peer] = { sent: 0, received: 0 });
    x.sent += t.sent; x.received += t.received;
  }
  const rows = s.members.map((m) => {
    const p = m.profile || {};
    const tr = traffic[m.peer] || {};
    const live = m.alive
      ? el("span", { class: "badge ok", title: `last heartbeat ${secs(m.last_seen_s)} ago`, text: "alive" })
      : el("span", { class: "badge bad", text: "dead" });
    return el("tr", { class: (m.self ? "self " : "") + (m.alive ? "alive" : "dead"), "data-peer": m.peer },
      el("td", { class: "mono", title: m.peer, text: short(m.peer) }),
      el("td", { text: m.role }),
      el("td", { title: p.device || "", text: p.name || "–" }),
      el("td", { class: "num", text: p.flops_fp32 ? (p.flops_fp32 / 1e9).toFixed(1) : "–" }),
      el("td", { class: "num", text: p.memory_bytes ? (p.memory_bytes / 2 ** 30).toFixed(1) + " GiB" : "–" }),
      el("td", {}, live, m.alive ? el("span", { class: "muted", text: ` ${secs(m.last_seen_s)}` }) : null),
      el("td", { class: "num", text: m.self ? "" : bytes(tr.sent) }),
      el("td", { class: "num", text: m.self ? "" : bytes(tr.received) }));
  });
  document.querySelector("#members tbody").replaceChildren(...rows);
  document.getElementById("members-note").textContent = s.members_truncated ? "(list cut: too many members)" : "";
}

// A perceptual colour ramp (viridis, five stops), interpolated.
const RAMP = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function ramp(t) {
  t = Math.max(0, Math.min(1, t)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(t)), f = t - i;
  const c = RAMP[i].map((a, k) => Math.round(a + (RAMP[i + 1][k] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function renderHeatmap(s) {
  const b = s.bandwidth, n = b.peers.length, box = document.getElementById("heatmap");
  if (n < 2) { box.replaceChildren(el("p", { class: "muted", text: "Fewer than two nodes: no links to show." })); return; }
  const vals = b.bytes_per_s.flat().filter((v) => v != null && v > 0);
  const lo = Math.log10(Math.min(...vals, 1e12)), hi = Math.log10(Math.max(...vals, 1));
  const cell = Math.max(14, Math.min(48, Math.floor(420 / n))), pad = 76;
  const size = pad + n * cell;
  const g = sv("svg", { viewBox: `0 0 ${size + 20} ${size + 46}`, width: size + 20, height: size + 46, id: "heatmap-svg" });
  const defs = sv("defs", {},
    sv("pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" },
      sv("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#0f1419", "stroke-width": 2 })));
  g.append(defs);
  b.peers.forEach((p, i) => {
    g.append(sv("text", { x: pad - 6, y: pad + i * cell + cell / 2 + 4, "text-anchor": "end", text: short(p) }));
    g.append(sv("text", { x: 0, y: 0, transform: `translate(${pad + i * cell + cell / 2 + 4},${pad - 6}) rotate(-60)`, text: short(p) }));
  });
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      const v = b.bytes_per_s[i][j], x = pad + j * cell, y = pad + i * cell;
      if (i === j) { g.append(sv("rect", { x, y, width: cell - 1, height: cell - 1, fill: "#1d242c" })); continue; }
      const t = v == null || hi <= lo ? 0.5 : (Math.log10(v) - lo) / (hi - lo);
      const title = `${short(b.peers[i])} → ${short(b.peers[j])}: ` + (v == null ? "unknown" :
        `${rate(v)}` + (b.rtt_s[i][j] != null ? `, rtt ${secs(b.rtt_s[i][j])}` : "") + (b.measured[i][j] ? " (probed)" : " (estimated)"));
      const r = sv("rect", { class: "cell" + (b.measured[i][j] ? " measured" : ""), x, y, width: cell - 1, height: cell - 1,
        fill: v == null ? "#2a333d" : ramp(t), "data-bps": v == null ? "" : v }, sv("title", { text: title }));
      g.append(r);
      if (v != null && !b.measured[i][j]) g.append(sv("rect", { x, y, width: cell - 1, height: cell - 1, fill: "url(#hatch)", opacity: 0.5 }));
    }
  }
  // legend
  const ly = size + 16, lw = n * cell;
  for (let k = 0; k < 32; k++) g.append(sv("rect", { x: pad + (k * lw) / 32, y: ly, width: lw / 32 + 0.5, height: 8, fill: ramp(k / 31) }));
  g.append(sv("text", { x: pad, y: ly + 22, text: rate(10 ** lo) }));
  g.append(sv("text", { x: pad + lw, y: ly + 22, "text-anchor": "end", text: rate(10 ** hi) }));
  if (b.truncated) g.append(sv("text", { x: 0, y: 12, text: "(first 64 nodes)" }));
  box.replaceChildren(g);
}

function lossCurve(points, steps) {
  const W = 520, H = 180, L = 44, R = 10, T = 10, B = 22;
  const g = sv("svg", { class: "loss-curve", viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  const pts = points.filter((p) => p[1] != null);
  if (!pts.length) { g.append(sv("text", { x: L, y: H / 2, text: "no loss reported yet" })); return g; }
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  const x0 = 0, x1 = Math.max(steps || 0, ...xs, 1);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const X = (v) => L + ((v - x0) / (x1 - x0)) * (W - L - R), Y = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  g.append(sv("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
  g.append(sv("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  for (const v of [y0, (y0 + y1) / 2, y1]) g.append(sv("text", { x: L - 4, y: Y(v) + 3, "text-anchor": "end", text: v.toFixed(2) }));
  g.append(sv("text", { x: L, y: H - 6, text: "step 0" }));
  g.append(sv("text", { x: W - R, y: H - 6, "text-anchor": "end", text: `step ${x1}` }));
  g.append(sv("polyline", { class: "loss", points: pts.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ") }));
  return g;
}

function planView(plan, me) {
  if (!plan) return el("p", { class: "muted", text: "plan: not known here yet" });
  const box = el("div", { class: "plan" });
  plan.stages.forEach((st, i) => {
    if (i > 0) {
      const f = plan.fences[i - 1];
      const comp = f && f.rho < 1;
      box.append(el("div", { class: "fence" + (comp ? " compressed" : "") },
        el("span", { class: "a", text: "→" }),
        el("span", { class: "rho", text: comp ? `AdaTopK ρ=${f.rho.toFixed(3)}` : "dense" })));
    }
    const reps = st.replicas.map((r) => el("div", { class: "r" + (r === me ? " me" : ""), title: r, text: short(r) }));
    box.append(el("div", { class: "stage" }, el("div", { class: "t", text: `stage ${i} · units ${st.units[0]}–${st.units[1]}` }), ...reps));
  });
  return el("div", {}, el("div", { class: "muted", text: `plan ${plan.plan_hash.slice(0, 12)} · epoch ${plan.epoch} · ${plan.algorithm} · ${plan.micro_batches} micro-batches · predicted step ${secs(plan.step_time_s)}` }), box);
}

function stateBadge(state) {
  const cls = { running: "ok", done: "ok", failed: "bad", cancelled: "warn", planned: "warn", pending: "warn" }[state] || "";
  return el("span", { class: "badge " + cls, text: state });
}

function renderJobs(s) {
  const box = document.getElementById("jobs");
  if (!s.jobs.length) { box.replaceChildren(el("p", { class: "muted", text: "No job seen yet." })); return; }
  const me = s.node.peer;
  box.replaceChildren(...s.jobs.map((j) => {
    const pr = j.progress || { step: -1, curve: [] };
    const steps = j.steps, done = pr.step + 1;
    const frac = steps ? Math.min(1, Math.max(0, done / steps)) : 0;
    const loc = j.local;
    const fill = el("div", {});
    fill.style.width = `${(100 * frac).toFixed(1)}%`;   // CSSOM, not a style attribute (the CSP forbids those)
    const stats = el("div", { class: "stats" },
      el("span", {}, "loss ", el("b", { text: num(pr.loss) })),
      el("span", {}, "step ", el("b", { text: steps ? `${Math.max(done, 0)}/${steps}` : String(Math.max(done, 0)) })),
      el("span", {}, "swarm ", el("b", { text: pr.tokens_per_s ? `${Math.round(pr.tokens_per_s)} tok/s` : "–" })));
    if (loc) {
      stats.append(el("span", {}, "here: stage ", el("b", { text: `${loc.stage}` }), " replica ", el("b", { text: `${loc.replica}` })),
        el("span", {}, "step time ", el("b", { text: secs(loc.step_s) })),
        el("span", {}, "compute ", el("b", { text: `${Math.round(100 * loc.compute_util)}%` })));
      if (loc.averaging) stats.append(el("span", {}, "averaging ", el("b", { text: `${loc.averaging.rounds} rounds` }), ` (last ${secs(loc.averaging.last_s)})`));
    }
    const left = el("div", {},
      el("h3", {}, el("span", { class: "mono", title: j.job, text: j.job.slice(0, 24) }), " ", stateBadge(j.state)),
      el("div", { class: "bar" }, fill),
      stats,
      j.reason ? el("p", { class: "muted", text: j.reason }) : null,
      planView(j.plan, me));
    return el("div", { class: "job", "data-job": j.job }, left, lossCurve(pr.curve || [], steps));
  }));
}

function renderRefusals(s) {
  const box = document.getElementById("refusals");
  const r = s.refusals;
  if (!r) { box.replaceChildren(el("p", { class: "muted", text: "Not counted on this node." })); return; }
  const entries = Object.entries(r.by_reason).sort((a, b) => b[1] - a[1]);
  if (!entries.length) { box.replaceChildren(el("p", { class: "muted", text: "Nothing refused." })); return; }
  box.replaceChildren(el("table", {}, el("tbody", {}, ...entries.map(([k, v]) =>
    el("tr", {}, el("td", { class: "mono", text: k }), el("td", { class: "num", text: String(v) }))))));
}

function render(s) {
  document.getElementById("node").textContent =
    `${s.node.role} ${short(s.node.peer)} · up ${secs(s.node.uptime_s)} · ${new Date(s.at * 1000).toLocaleTimeString()}`;
  renderSummary(s);
  renderMembers(s);
  renderHeatmap(s);
  renderJobs(s);
  renderRefusals(s);
  document.body.dataset.updated = String(s.at);
}

async function poll() {
  const conn = document.getElementById("conn");
  try {
    const r = await fetch("/api/status", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
    conn.className = "badge ok"; conn.textContent = "live";
  } catch (e) {
    conn.className = "badge bad"; conn.textContent = "offline: " + e.message;
  }
  setTimeout(poll, POLL_MS);
}

poll();

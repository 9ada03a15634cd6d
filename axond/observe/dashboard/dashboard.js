// The axond coordinator's dashboard: polls /api/state and draws jobs (goodput, its history, ranks and what each
// is blocked in) and nodes. Vanilla JS, no dependencies; text is set with textContent, never parsed as HTML.
"use strict";

const COLORS = {productive: "#2da44e", startup: "#8c959f", waiting_for_members: "#bf8700", detection: "#cf222e",
                reformation: "#8250df", hung: "#fb8f44"};
const REFRESH_MS = 2000;
const token = new URLSearchParams(window.location.search).get("token");

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function row(cells) {
  const tr = el("tr");
  for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", c));
  return tr;
}

function td(node) {
  const cell = el("td");
  cell.appendChild(node);
  return cell;
}

function seconds(s) {
  return s >= 3600 ? (s / 3600).toFixed(1) + " h" : s >= 60 ? (s / 60).toFixed(1) + " min" : s.toFixed(1) + " s";
}

function goodputBar(job, causes) {
  const bar = el("div", null, "bar");
  const wall = job.wall_s || 0;
  for (const cause of causes) {
    const part = job.goodput[cause] || 0;
    if (wall <= 0 || part <= 0) continue;
    const span = el("span");
    span.style.width = (100 * part / wall) + "%";
    span.style.background = COLORS[cause] || "#999";
    span.title = cause + ": " + seconds(part);
    bar.appendChild(span);
  }
  return bar;
}

function legend(job, causes) {
  const box = el("div", null, "legend");
  for (const cause of causes) {
    const item = el("span");
    const swatch = el("span", null, "swatch");
    swatch.style.background = COLORS[cause] || "#999";
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(cause.replace(/_/g, " ") + " " + seconds(job.goodput[cause] || 0)));
    box.appendChild(item);
  }
  return box;
}

const PLOT = {w: 480, h: 90, pad: 4, top: 20};

function svgText(svg, x, y, text, fill) {
  const t = document.createElementNS("http://www.w3.org/2000/svg", "text");
  t.setAttribute("x", x);
  t.setAttribute("y", y);
  t.setAttribute("fill", fill || "#555");
  t.textContent = text;
  svg.appendChild(t);
}

function linePlot(cls, points, most, color, label, empty) {
  // one line over [t, v] points, v scaled to `most`; `empty` is said instead when there are fewer than two points
  const ns = "http://www.w3.org/2000/svg";
  const {w, h, pad, top} = PLOT;
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  svg.setAttribute("class", cls);
  if (points.length < 2) {
    svgText(svg, 8, h / 2, empty, "#777");
    return svg;
  }
  const t0 = points[0][0], t1 = points[points.length - 1][0];
  const x = t => pad + (w - 2 * pad) * (t - t0) / Math.max(t1 - t0, 1e-9);
  const y = v => h - pad - (h - pad - top) * v / most;
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.map(p => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", color);
  line.setAttribute("stroke-width", "2");
  svg.appendChild(line);
  svgText(svg, 8, 14, label(t1 - t0));
  return svg;
}

function historyPlot(job) {
  // goodput (productive / wall) at each sample the coordinator kept
  const points = job.history.filter(p => p[1] > 0).map(p => [p[0], p[2] / p[1]]);
  return linePlot("goodput-plot", points, 1, COLORS.productive,
                  span => "goodput (productive / wall) over " + seconds(span),
                  "goodput over time: not enough samples yet");
}

function pacePlot(job) {
  // the time between step ends (ranks that call axond.mark_step(), as DistributedTrainer does), else between the
  // ranks' arrival marks (every `ops` collectives): a straggler or a hang shows as a rise
  const pace = job.pace || {};
  const per = pace.kind === "steps" ? "ms per step (rank " + pace.rank + ")"
                                    : "ms per " + pace.ops + " collectives ('" + pace.group + "')";
  const points = pace.points || [];
  const values = points.map(p => p[1]).sort((a, b) => a - b);
  const most = Math.max(...values, 1e-9);
  const median = values.length ? values[Math.floor(values.length / 2)] : 0;
  return linePlot("pace-plot", points, most, "#0969da",
                  span => per + ", last " + seconds(span) +
                          ": median " + median.toFixed(1) + ", max " + most.toFixed(1),
                  "recent pace: no arrival marks yet (the ranks publish them as they run collectives)");
}

function timelineLink(job) {
  // the job's merged timeline, where the coordinator sees the ranks' timeline directory (AXOND_TIMELINE)
  const query = "job=" + encodeURIComponent(job.job) + (token ? "&token=" + encodeURIComponent(token) : "");
  const link = el("a", "download the merged timeline (Perfetto, chrome://tracing)", "timeline");
  link.href = "api/timeline?" + query;
  link.download = job.job + "-timeline.json";
  return link;
}

function drawJob(job, causes, timeline) {
  const box = el("div", null, "job");
  box.dataset.job = job.job;
  const title = el("h3");
  title.appendChild(document.createTextNode(job.job + " "));
  title.appendChild(el("span", job.state, "state-" + job.state));
  box.appendChild(title);
  const ratio = job.wall_s > 0 ? (100 * (job.goodput.productive || 0) / job.wall_s).toFixed(1) + " %" : "-";
  box.appendChild(el("div", "generation " + job.generation + " · " + job.nodes + " node(s), world size " +
                     job.world_size + " · restarts " + job.restarts + "/" + job.max_restarts + " · wall " +
                     seconds(job.wall_s) + " · goodput " + ratio, "muted"));
  if (job.reason) box.appendChild(el("div", "reason: " + job.reason));
  box.appendChild(goodputBar(job, causes));
  box.appendChild(legend(job, causes));
  box.appendChild(historyPlot(job));
  box.appendChild(pacePlot(job));
  if (timeline) box.appendChild(el("div")).appendChild(timelineLink(job));
  const table = el("table", null, "ranks");
  table.appendChild(row(["rank", "node", "host", "pid", "node rank", "local rank", "blocked in", "straggler"]
                        .map(t => el("th", t))));
  for (const r of job.ranks) {
    table.appendChild(row([r.rank, r.node, r.host || "-", r.pid || "-", r.node_rank, r.local_rank,
                           el("td", r.blocked || "-", r.blocked ? "blocked" : "muted"),
                           el("td", r.straggler || "-", r.straggler ? "blocked" : "muted")]));
  }
  box.appendChild(table);
  if (job.ranks_omitted) box.appendChild(el("div", job.ranks_omitted + " more ranks not shown", "muted"));
  return box;
}

function draw(data) {
  const jobs = document.getElementById("jobs");
  jobs.replaceChildren(...data.jobs.map(j => drawJob(j, data.causes, data.timeline)));
  if (!data.jobs.length) jobs.appendChild(el("div", "no jobs", "muted"));
  document.getElementById("job-count").textContent = data.jobs.length;
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren(...data.nodes.map(n => row([n.node, n.host, el("td", n.health, "health-" + n.health),
                                                     n.heartbeat_age_s.toFixed(1) + " s", n.slots, n.mode,
                                                     n.job || "-"])));
  document.getElementById("node-count").textContent = data.nodes.length;
  document.getElementById("updated").textContent = new Date(data.at * 1000).toLocaleTimeString();
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

async function refresh() {
  const error = document.getElementById("error");
  try {
    const answer = await fetch("api/state", {headers: token ? {"Authorization": "Bearer " + token} : {},
                                             cache: "no-store"});
    if (!answer.ok) {
      error.textContent = "the coordinator answered " + answer.status + ": " + (await answer.text());
      return;
    }
    draw(await answer.json());
    error.textContent = "";
  } catch (e) {
    error.textContent = "cannot reach the coordinator: " + e;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();

"""The gradient agreement read right: cos and norm_ratio together (anomaly/agreement.py), and the
report's agreement section (signed cos on a linear scale, the rank named), over the cos and
norm_ratio of real data-parallel gradients: one model, each rank its own batches, rank 2 of 4 fed
inputs x40 from step 6, the agreement computed with plain torch on the whole gradients, written as
msmon's grad_agreement CSV rows and loaded by `msmon db`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import pytest
import torch
from test_report_ranks import browse, console, only, with_script  # noqa: E402
from test_results_report import chromium  # noqa: E402

from msmon.anomaly.agreement import StepAgreement  # noqa: E402
from msmon.offline.results import db, queries, report_html  # noqa: E402

BAD_RANK, BAD_STEP, STEPS = 2, 6, 12


def gradients(ranks: int, steps: int, scaled: int, from_step: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Per step, each rank's whole flat rank-local gradient of a small MLP trained data-parallel
    (gradients averaged, clipped, AdamW), rank `scaled` fed inputs x40 from `from_step`."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(50 + r) for r in range(ranks)]
    out = []
    for step in range(steps):
        flat = []
        for rank in range(ranks):
            x = torch.randn(16, 8, generator=gens[rank])
            y = x[:, :4].clone()
            if rank == scaled and step >= from_step:
                x = x * 40
            model.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            flat.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
        out.append(flat)
        reduced = torch.stack(flat).mean(0)
        offset = 0
        for p in model.parameters():
            p.grad = reduced[offset : offset + p.numel()].view_as(p).float()
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    return out


def agreement_rows(grads: list[list[torch.Tensor]]) -> list[list[tuple[float, float]]]:
    """(cos, norm_ratio) per step and rank, as grad_agreement defines them (docs/loss.md)."""
    rows = []
    for flat in grads:
        reduced = torch.stack(flat).mean(0)
        rows.append(
            [
                (float(torch.dot(g, reduced) / (g.norm() * reduced.norm())), float(g.norm() / reduced.norm()))
                for g in flat
            ]
        )
    return rows


def of_step(step: int, row: list[tuple[float, float]]) -> StepAgreement:
    """What the report's one SQL pass gives for a step, computed here with statistics."""
    import statistics

    ratios = [q for _, q in row]
    top = max(range(len(row)), key=lambda r: ratios[r])
    median = statistics.median(ratios)
    mad = statistics.median(abs(q - median) for q in ratios)
    return StepAgreement(
        step, len(row), top, row[top][0], ratios[top], median, mad, sum(ratios), sum(c for c, _ in row)
    )


def test_the_dominating_rank_keeps_a_high_cos_while_the_others_fall_and_its_norm_ratio_points_at_it():
    rows = agreement_rows(gradients(4, STEPS, BAD_RANK, BAD_STEP))
    healthy = rows[BAD_STEP - 1]
    bad = rows[BAD_STEP]
    assert all(c > 0.3 for c, _ in healthy)  # healthy steps: every rank agrees with the average
    assert bad[BAD_RANK][0] > 0.7 and all(bad[r][0] < 0.3 for r in range(4) if r != BAD_RANK)  # the reading
    assert bad[BAD_RANK][1] > 3 and all(bad[r][1] < 0.6 for r in range(4) if r != BAD_RANK)


def test_cos_with_the_others_and_the_agreement_without_a_rank_equal_plain_torch_from_cos_and_norm_ratio():
    grads = gradients(4, STEPS, BAD_RANK, BAD_STEP)
    for step in (BAD_STEP - 1, BAD_STEP, STEPS - 1):
        flat = grads[step]
        a = of_step(step, agreement_rows(grads)[step])
        others = torch.stack([g for r, g in enumerate(flat) if r != a.rank]).sum(0)
        mine = flat[a.rank]
        assert a.cos_with_others() == pytest.approx(
            float(torch.dot(mine, others) / (mine.norm() * others.norm())), abs=1e-9
        )
        reduced = torch.stack(flat).mean(0)
        cos = [float(torch.dot(g, reduced) / (g.norm() * reduced.norm())) for r, g in enumerate(flat) if r != a.rank]
        assert a.others_cos() == pytest.approx(sum(cos) / 3, abs=1e-9)
        rest = torch.stack([g for r, g in enumerate(flat) if r != a.rank])
        assert a.agreement_without() == pytest.approx(float(rest.sum(0).norm() / rest.norm(dim=1).sum()), rel=1e-9)


def test_a_rank_dominates_from_the_step_its_norm_ratio_leaves_the_others_and_never_on_healthy_steps():
    for seed in range(3):
        rows = agreement_rows(gradients(4, STEPS, BAD_RANK, BAD_STEP, seed))
        named = [(s, of_step(s, row).rank) for s, row in enumerate(rows) if of_step(s, row).dominates()]
        assert named and named[0] == (BAD_STEP, BAD_RANK), f"seed {seed}: {named}"
        assert all(rank == BAD_RANK and s >= BAD_STEP for s, rank in named)
        a = of_step(BAD_STEP, rows[BAD_STEP])
        assert a.cos_with_others() < 0.3 < a.cos and a.others_cos() < 0.3 < a.agreement_without()
    two = agreement_rows(gradients(2, STEPS, 1, BAD_STEP))
    named = [(s, of_step(s, row).rank) for s, row in enumerate(two) if of_step(s, row).dominates()]
    assert named and named[0] == (BAD_STEP, 1) and all(s >= BAD_STEP for s, _ in named)
    assert "one step cannot tell which is wrong" in of_step(BAD_STEP, two[BAD_STEP]).describe()


def write_run(out: Path, rows: list[list[tuple[float, float]]]) -> None:
    """Each rank's grad_agreement CSV as msmon writes it (vpp_stage,name,step,cos,norm_ratio)."""
    for rank in range(len(rows[0])):
        folder = out / f"Dec06_10-00-00-rank{rank}-0000000{rank}"
        folder.mkdir(parents=True)
        lines = ["vpp_stage,name,step,cos,norm_ratio"]
        lines += [f"0,model,{step},{row[rank][0]!r},{row[rank][1]!r}" for step, row in enumerate(rows)]
        (folder / f"grad_agreement_0-{len(rows) - 1}.csv").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def agreement_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("agreement")
    rows = agreement_rows(gradients(4, STEPS, BAD_RANK, BAD_STEP))
    write_run(base / "out", rows)
    database = str(base / "run.duckdb")
    db.load([str(base / "out")], database, progress=False)
    return base, database, rows


def test_the_report_draws_each_ranks_signed_cos_and_norm_ratio_and_names_the_dominating_rank(agreement_run):
    _, database, rows = agreement_run
    con = duckdb.connect(database, read_only=True)
    data = queries.report_data(con)
    con.close()
    chart = data["agreement"]
    assert (chart["rows"], chart["columns"], chart["first_step"], chart["step_width"]) == ([0, 1, 2, 3], STEPS, 0, 1)
    for rank in range(4):
        for step in range(STEPS):  # signed, as recorded (a |value| on a log scale lost the sign)
            assert chart["cos"][rank][step] == pytest.approx(rows[step][rank][0], rel=1e-6)
            assert chart["norm_ratio"][rank][step] == pytest.approx(rows[step][rank][1], rel=1e-6)
    assert any(c < 0 for row in chart["cos"] for c in row)  # healthy ranks' cos crosses zero here
    dominant = chart["dominant"]
    assert (dominant["rank"], dominant["step"], dominant["ranks"]) == (BAD_RANK, BAD_STEP, [BAD_RANK])
    assert dominant["text"].startswith(f"From step {BAD_STEP}, rank {BAD_RANK} dominates the reduced gradient")
    assert "not that their data departs" in dominant["text"]
    assert "grad_agreement" not in {h["category"] for h in data["heatmaps"]}  # no |cos| on a log scale


def _signed(c: float) -> tuple[int, int, int]:
    """agreement.js's colour of a cos: linear from white (0) to blue (+1) or red (-1)."""
    mid, end = (247, 247, 247), ((33, 102, 172) if c >= 0 else (178, 24, 43))
    f = min(abs(c), 1.0)
    return tuple(round(m + f * (e - m)) for m, e in zip(mid, end))  # type: ignore[return-value]


@pytest.mark.browser
def test_the_agreement_section_colours_signed_cos_linearly_and_names_the_rank_in_chromium(agreement_run, tmp_path):
    browser = chromium()
    base, database, rows = agreement_run
    page = tmp_path / "report.html"
    con = duckdb.connect(database, read_only=True)
    report_html.build(con, str(page), database)
    con.close()
    healthy = min(((r, s) for s in range(BAD_STEP, STEPS) for r in range(4)), key=lambda rs: rows[rs[1]][rs[0]][0])
    cells = {"bad": (BAD_RANK, BAD_STEP), "lowest": healthy, "before": (0, BAD_STEP - 1)}
    read = """
      var cv = document.getElementById("agreement-cos"), at = cv.getAttribute("data-cell").split(",").map(Number);
      var out = {}, img = cv.getContext("2d").getImageData(0, 0, cv.width, cv.height).data;  // one read
      CELLS.forEach(function (c) {
        var i = 4 * ((at[1] + c[1] * at[3] + 1) * cv.width + at[0] + c[2] * at[2] + 1);
        out[c[0]] = [img[i], img[i + 1], img[i + 2]];
      });
      document.body.setAttribute("data-pixels", JSON.stringify(out));""".replace(
        "CELLS", json.dumps([[k, r, s] for k, (r, s) in cells.items()])
    )
    dom = browse(browser, tmp_path / "profile", with_script(page, read, "read.html"), "--dump-dom")
    assert not console(dom), "\n".join(console(dom))
    body = re.search(r"<body[^>]*>", dom.stdout)[0]
    assert 'data-rendered="ok"' in body, dom.stderr[-2000:]
    pixels = json.loads(re.search(r'data-pixels="([^"]*)"', body)[1].replace("&quot;", '"'))
    for key, (rank, step) in cells.items():
        expected = _signed(rows[step][rank][0])
        assert all(abs(p - e) <= 1 for p, e in zip(pixels[key], expected)), (key, pixels[key], expected)
    assert rows[healthy[1]][healthy[0]][0] < 0 and pixels["lowest"][0] > pixels["lowest"][2]  # negative: red
    assert pixels["bad"][2] > pixels["bad"][0]  # the dominating rank's high cos: blue
    assert f'id="agreement-verdict" data-rank="{BAD_RANK}" data-step="{BAD_STEP}"' in dom.stdout
    assert f"From step {BAD_STEP}, rank {BAD_RANK} dominates the reduced gradient" in dom.stdout
    top = dom.stdout[dom.stdout.index('id="verdict"') : dom.stdout.index('class="cards"')]
    assert 'id="agreement-line"' in top  # named at the top of the page too
    assert "<canvas width=" in dom.stdout and 'id="agreement-norm_ratio"' in dom.stdout
    shot = tmp_path / "agreement.png"
    browse(
        browser,
        tmp_path / "profile",
        with_script(page, only("agreement-section"), "shot.html"),
        "--hide-scrollbars",
        "--window-size=1280,900",
        f"--screenshot={shot}",
    )
    assert shot.is_file() and shot.stat().st_size > 10_000, "a drawn section, not a blank page"
    print(f"screenshot: {shot}")

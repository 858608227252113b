"""`fluxgrpo report`: a self-contained report.html (curves, eval grids, facts) from a run folder, and --png."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fluxgrpo.cli.app import app

pytest.importorskip("matplotlib")

runner = CliRunner()


class Collector(HTMLParser):
    """Counts tags and checks that every opened non-void element is closed in order (a well-formed page)."""

    VOID = frozenset({"meta", "img", "br", "link", "input", "hr"})

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.stack: list[str] = []
        self.images: list[str] = []
        self.external: list[str] = []
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        attributes = dict(attrs)
        for name in ("src", "href"):
            value = attributes.get(name) or ""
            if value and not value.startswith(("data:", "#")):
                self.external.append(value)
        if tag == "img":
            self.images.append(attributes.get("alt") or "")
        if tag == "title":
            self._in_title = True
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        if tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def parse(path: Path) -> Collector:
    collector = Collector()
    collector.feed(path.read_text(encoding="utf-8"))
    collector.close()
    assert collector.stack == [], f"unclosed elements {collector.stack}"
    return collector


def fake_run(
    folder: Path, iterations: int = 6, eval_every: int = 2, reward_shift: float = 0.0, kl: float = 0.0
) -> Path:
    """A run folder as training writes it: metrics.jsonl with train and eval records, config.yaml, run_info.json,
    and eval/iteration-<k>/ folders holding images and a sample-format index.json with scores."""
    from PIL import Image

    folder.mkdir(parents=True)
    lines = []
    prompts = ["a red fox in the snow", "an oil painting of a lighthouse", "a <b>bold</b> & tricky prompt"]
    for k in range(0, iterations + 1):
        if k:
            lines.append(
                {
                    "iteration": k,
                    "reward_mean": 0.5 + 0.01 * k + reward_shift,
                    "reward_std": 0.01,
                    "reward_min": 0.48 + 0.01 * k,
                    "reward_max": 0.53 + 0.01 * k,
                    "group_std_mean": 0.01 + 0.001 * k,
                    "zero_std_group_fraction": 0.0,  # constant, as in a healthy run
                    "ratio_mean": 1.0,
                    "ratio_min": 0.99 - 0.001 * k,
                    "ratio_max": 1.01 + 0.001 * k,
                    "clip_fraction": 0.1 + 0.01 * k,
                    "loss": 0.001 * k,
                    "grad_norm_mean": 0.2 + 0.01 * k,
                    "grad_norm_max": 0.3 + 0.01 * k,
                    "lr": 1e-5,  # constant: no warm-up
                    "seconds_rollout": 1.0 + 0.1 * k,
                    "seconds_decode_reward": 0.1,
                    "seconds_update": 2.0,
                    "images_per_second": 3.0 - 0.1 * k,
                    "peak_memory_gib": None,
                    "nonfinite_rewards": 0.0,
                    "skipped_steps": 0.0,
                    "kl": kl * k,  # 0 when the KL term is off
                }
            )
        if k % eval_every == 0:
            record = {"iteration": k, "eval_brightness_mean": 0.4 + 0.02 * k, "eval_brightness_std": 0.05}
            if k > 0:  # a later evaluation's paired noise against iteration 0, as training logs it
                record.update({"eval_brightness_change_noise": 0.03, "eval_change_from": 0})
            lines.append(record)
            out = folder / "eval" / f"iteration-{k}"
            out.mkdir(parents=True)
            images = []
            for i, prompt in enumerate(prompts):
                name = f"{i:04d}_00.png"
                Image.new("RGB", (32, 32), (40 * k % 255, 80 * i, 120)).save(out / name)
                images.append({"file": name, "prompt": prompt, "prompt_index": i, "image_index": 0, "seed": 7 + i})
            index = {
                "format": "fluxgrpo-sample-index",
                "format_version": 1,
                "prompts": prompts,
                "images": images,
                "iteration": k,
                "scores": {"brightness": {"mean": 0.4 + 0.02 * k, "std": 0.05}},
            }
            (out / "index.json").write_text(json.dumps(index))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "config.yaml").write_text("# Derived:\n#   world_size: 1\nreward: brightness\nmax_train_steps: 6\n")
    (folder / "run_info.json").write_text(
        json.dumps({"versions": {"fluxgrpo": "0.1.0", "torch": "2.x"}, "hardware": {"device_type": "cpu"}})
    )
    return folder


def test_report_html_is_self_contained_and_shows_curves_grids_and_facts(tmp_path):
    run = fake_run(tmp_path / "my-run")
    result = runner.invoke(app, ["report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    html_path = Path(document["html"])
    assert html_path == run / "report.html"
    page = parse(html_path)
    assert "my-run" in page.title
    assert page.external == []  # nothing to fetch: no network needed to view it
    assert page.tags["svg"] == len(document["panels"]) >= 8
    assert "Train reward (mean, min–max band)" in document["panels"]
    assert any(p.startswith("Eval brightness") for p in document["panels"])
    assert not any(p.startswith("KL") for p in document["panels"])
    from fluxgrpo.report.figures import panels_for
    from fluxgrpo.report.run import read_run

    titles = [panel.title for panel in panels_for([read_run(run)])]
    assert "Eval brightness (held-out prompts, mean ± std)" in titles
    assert not any("change noise" in title for title in titles)  # a noise figure, not a score of the images
    # 4 evaluations (0, 2, 4, 6) × 3 prompts, same prompt on a row
    assert len(page.images) == 12
    assert "iteration 0, prompt 0, seed 7" in page.images
    assert "iteration 6, prompt 2, seed 9" in page.images
    text = html_path.read_text()
    assert "a &lt;b&gt;bold&lt;/b&gt; &amp; tricky prompt" in text  # prompts are escaped, not markup
    assert "max_train_steps" in text and "device_type" in text and "torch" in text
    assert "best 0.52 at iteration 6" in document["summary"]
    assert document["evaluations"] == [4] and document["iterations"] == [6]


def test_compare_overlays_runs_and_png_is_written(tmp_path):
    from PIL import Image

    a = fake_run(tmp_path / "dance")
    b = fake_run(tmp_path / "mixgrpo", reward_shift=0.05, kl=0.01)
    out = tmp_path / "both.html"
    result = runner.invoke(app, ["report", str(a), "--compare", str(b), "--png", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    page = parse(out)
    assert "dance" in page.title and "mixgrpo" in page.title
    assert "KL to the reference" in document["panels"]  # one run has a KL term
    text = out.read_text()
    assert ">dance</text>" in text and ">mixgrpo</text>" in text  # the curves' legends name each run
    assert len(page.images) == 24  # each run's grid
    with Image.open(document["png"]) as figure:
        assert figure.format == "PNG" and figure.width > 800


def test_run_without_evaluations_or_facts_still_reports(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "reward_mean": 0.5}) + "\n")
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    text = (run / "report.html").read_text()
    assert "--eval-every" in text and "run_info.json" in text


def test_not_a_run_folder_says_what_to_pass(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 1
    assert "metrics.jsonl" in result.stderr and "--output-dir" in result.stderr


# Injected into a copy of the report (the report itself runs no script): what a reader at this width would have to
# scroll sideways, written where --dump-dom prints it.
MEASURE_SCRIPT = """<script>
const page = document.documentElement;
const overflowing = [...document.querySelectorAll("table.grid th, table.facts td")]
  .filter((cell) => cell.scrollWidth > cell.clientWidth + 1).length;
const grids = [...document.querySelectorAll(".gridwrap")].filter((g) => g.scrollWidth > g.clientWidth).length;
const colour = (element) => getComputedStyle(element).backgroundColor;
const hidden = [...document.querySelectorAll(".tag")].filter((tag) => colour(tag) === colour(tag.parentElement));
document.body.dataset.measured = `${page.scrollWidth - page.clientWidth} ${overflowing} ${grids} ${hidden.length}`;
</script></body>"""


def _chromium(*args: str) -> str:
    command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=120).stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium package")
@pytest.mark.parametrize("width", [1280, 800])
def test_report_fits_the_window_in_headless_chromium(tmp_path, width):
    """Issue #31.3: at 800 px nothing scrolls sideways: three eval rewards fit a grid header, a long config value
    wraps, the four-column grid fits its box; the fired column's tag stands out of its tint; and the page draws (not
    a blank or an error screen)."""
    from PIL import Image

    run = fake_run(tmp_path / "shown")
    for index_file in run.glob("eval/*/index.json"):  # three evaluated rewards, as --eval-rewards exposure,hpsv2
        index = json.loads(index_file.read_text())
        index["scores"] |= {"exposure": {"mean": 0.8736, "std": 0.01}, "imagereward": {"mean": -2.2871, "std": 0.1}}
        index_file.write_text(json.dumps(index))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "eval_brightness_mean" in record:
            record |= {"eval_exposure_mean": 0.8736, "eval_imagereward_mean": -2.2871 + record["iteration"]}
    records.append({"iteration": 4, "record": "guards", "guard_exposure_value": 0.8, "guard_exposure_fired": 1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.yaml").write_text("objective: grpo\nlora_targets: " + ",".join(["attn.to_q"] * 60) + "\n")
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    page = (run / "report.html").read_text()
    assert "exposure 0.8736" in page and "imagereward -2.287" in page
    measured = tmp_path / "measured.html"
    measured.write_text(page.replace("</body>", MEASURE_SCRIPT))
    dom = _chromium(f"--window-size={width},1000", "--dump-dom", measured.as_uri())
    measured_numbers = dom.split('data-measured="')[1].split('"')[0].split()
    sideways, overflowing_cells, scrolling_grids, unreadable_tags = map(int, measured_numbers)
    assert (sideways, overflowing_cells, scrolling_grids) == (0, 0, 0)
    assert unreadable_tags == 0  # a "guard fired" tag drawn in its column's tint would vanish
    assert "guard fired</span>" in page
    shot = tmp_path / "shot.png"
    _chromium(f"--screenshot={shot}", f"--window-size={width},1000", (run / "report.html").as_uri())
    with Image.open(shot) as image:
        colours = image.convert("RGB").resize((64, 50)).getcolors(64 * 50)
    assert len(colours) > 20


def _damage_png(run: Path) -> None:
    png = sorted(run.glob("eval/*/*.png"))[0]
    png.write_bytes(png.read_bytes()[:60])


def _extreme_metrics(run: Path) -> None:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for number, record in enumerate(records):
        for key, value in record.items():
            if isinstance(value, float):
                record[key] = (1e308, -1e308, 1e-308, "x")[number % 4]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize(
    "damage",
    [
        _damage_png,
        lambda run: (run / "config.yaml").write_bytes(b"\x00\xff\xfe binary"),
        lambda run: (run / "run_info.json").write_text('{"versions": 5, "hardware": ["x"]}'),
        lambda run: (run / "run_info.json").write_text("[1, 2]"),
        _extreme_metrics,
    ],
    ids=["truncated-eval-png", "binary-config", "odd-run-info", "list-run-info", "extreme-metrics"],
)
def test_a_damaged_run_file_still_gives_a_report(tmp_path, damage):
    """Issue #23.6: each of these was a traceback; the report now renders without what it cannot read."""
    run = fake_run(tmp_path / "run")
    damage(run)
    result = runner.invoke(app, ["report", str(run), "--png"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert (run / "report.html").stat().st_size > 0 and (run / "report.png").stat().st_size > 0


def test_the_grid_marks_best_and_the_fired_guard_and_wraps_long_values(tmp_path):
    """Issue #31.4: the column where a guard fired is marked (best/'s alike: test_guards has a real best/); long
    config values wrap instead of widening the page; an objective metric that is the loss itself gets no second panel."""
    run = fake_run(tmp_path / "marked")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "reward_mean" in record:
            record["policy_loss"] = record["loss"]  # nft without a KL: the same numbers
    records.append({"iteration": 4, "record": "guards", "guard_exposure_value": 0.8, "guard_exposure_fired": 1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.yaml").write_text("reward: brightness\nlora_targets: " + ",".join(["attn.to_q"] * 40) + "\n")
    result = runner.invoke(app, ["report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    text = (run / "report.html").read_text()
    assert "<th class=fired>iteration 4" in text and "guard fired</span>" in text
    assert text.count("<td class=fired><img") == 3  # the whole column is tinted: one image per prompt
    document = json.loads(result.stdout)
    assert "Policy loss" not in document["panels"] and "Loss" in document["panels"]
    assert "overflow-wrap:anywhere" in text  # the facts table wraps a long value


def test_a_metric_constant_throughout_gets_a_number_not_a_flat_panel(tmp_path):
    """Issue #31.1: a tiny run's flat lines (clip fraction 0, a constant learning rate) are one line of values, not
    panels; a metric that varies keeps its panel, and a metric never finite (CPU peak memory) is named."""
    run = fake_run(tmp_path / "flat")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "reward_mean" in record:
            record["clip_fraction"] = 0.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = runner.invoke(app, ["report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    panels = json.loads(result.stdout)["panels"]
    assert "Clip fraction" not in panels and "Learning rate" not in panels
    assert "Groups with zero reward spread" not in panels
    assert "Loss" in panels and "Gradient norm (before clipping)" in panels  # these vary
    text = (run / "report.html").read_text()
    assert parse(run / "report.html").tags["svg"] == len(panels)
    (line,) = [part for part in text.split("<p class='note flat'>")[1:]]
    line = line.split("</p>")[0]
    assert line.startswith("Constant during this run (no panel): ")
    assert "clip_fraction = 0," in line and "lr = 1e-05" in line and "zero_std_group_fraction = 0" in line
    assert "loss =" not in line and "reward_mean" not in line
    assert "Logged without a finite value (no panel): peak_memory_gib." in line


def test_two_runs_at_different_constants_keep_the_panel(tmp_path):
    """Overlaid, a metric constant in each run but not the same in both still shows how the runs differ."""
    a = fake_run(tmp_path / "a")
    b = fake_run(tmp_path / "b")
    records = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "reward_mean" in record:
            record["lr"] = 2e-5
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = runner.invoke(app, ["report", str(a), "--compare", str(b), "--out", str(tmp_path / "r.html"), "--json"])
    assert result.exit_code == 0, result.output
    panels = json.loads(result.stdout)["panels"]
    assert "Learning rate" in panels and "Groups with zero reward spread" not in panels
    assert "Constant during these runs (no panel): zero_std_group_fraction = 0" in (tmp_path / "r.html").read_text()


def _config_table(page: str) -> str:
    return page.split("<h3>Resolved config</h3>", 1)[1].split("</table>", 1)[0]


@pytest.mark.parametrize(
    ("objective", "shown", "left_out"),
    [
        (
            "nft",
            ["nft_beta", "fm_timesteps", "kl_beta", "adv_clip_max"],
            ["clip_range", "eta", "sampler", "awm_weighting"],
        ),
        (
            "grpo",
            ["clip_range", "eta", "sampler", "kl_beta", "timestep_fraction"],
            ["nft_beta", "fm_draws", "awm_time_type"],
        ),
    ],
)
def test_the_config_table_leaves_out_what_the_objective_does_not_read(tmp_path, objective, shown, left_out):
    """Issue #31.2: the objectives' catalogue says which settings an objective reads; the others are named under the
    table, not listed in it as if they had shaped the run."""
    from fluxgrpo.config import build_config, save_resolved

    run = fake_run(tmp_path / objective)
    cfg = build_config("tiny-cpu", {"objective": objective})
    save_resolved(cfg, run / "config.yaml", cfg.derived(1))
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    page = (run / "report.html").read_text()
    table = _config_table(page)
    for key in shown:
        assert f"<td>{key}</td>" in table
    for key in left_out:
        assert f"<td>{key}</td>" not in table
    note = page.split("Not shown: ", 1)[1].split("</p>", 1)[0]
    assert set(left_out) <= set(note.split(" (")[0].split(", "))
    assert f"(--objective {objective} does not read them)" in note


def test_the_settings_an_objective_does_not_read_are_config_fields():
    """A renamed setting would silently stay in the table: every name the catalogue gives is a TrainConfig field."""
    from fluxgrpo.config import config_fields
    from fluxgrpo.grpo.objectives.catalogue import CATALOGUE, TRAJECTORY_SETTINGS

    names = {field.name for field in config_fields()}
    assert set(TRAJECTORY_SETTINGS) <= names
    for entry in CATALOGUE.values():
        assert set(entry.ignores) | set(entry.options) <= names, entry.name


def test_the_summary_says_whether_the_held_out_change_is_beyond_noise(tmp_path):
    """Issue #50.12: train's closing line says within / beyond noise; the report's summary said only first → last."""
    from fluxgrpo.report.html import summary_text
    from fluxgrpo.report.run import read_run

    run = fake_run(tmp_path / "run")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "eval_brightness_mean" in record:
            record["eval_seconds"] = 1.0  # as every evaluation logs it
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = " ".join(summary_text(read_run(run)).split())
    assert "0.4 at iteration 0 → 0.52 at iteration 6 (+0.1200, beyond noise (±0.0300: 2 standard errors of the " in text
    assert "per-image change, the same seeds at both)); best 0.52 at iteration 6" in text


def test_report_without_matplotlib_is_one_line_naming_the_install(tmp_path, monkeypatch):
    import sys

    run = fake_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pip install 'fluxgrpo[report]'" in errors[0], result.stderr
    assert not (run / "report.html").exists()


def test_loss_and_ratio_ticks_are_plain_numbers_and_long_titles_fit(tmp_path):
    """Issue #50.14: the loss and ratio panels read "1e-8" / "1e-7+1" in a corner; a long title was cut at both ends."""
    from fluxgrpo.report.figures import Line, Panel, _draw_panel, _figure
    from fluxgrpo.report.run import read_run

    run = fake_run(tmp_path / "run")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "loss" in record:
            record["loss"] = 1e-8 * (1 + record["iteration"])
            record["ratio_mean"] = 1 + 1e-7 * record["iteration"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = read_run(run)
    long_title = "Eval shapes: every claim, presence, counts, colours and positions (held-out prompts, mean ± std)"
    for panel in (
        Panel("Loss", "loss", [Line("loss", "loss")]),
        Panel("Probability ratio", "ratio", [Line("ratio_mean", "mean")]),
        Panel(long_title, "loss", [Line("loss", "loss")]),
    ):
        figure = _figure(1, 1, 4.6, 2.9)  # the report's panel size
        ax = figure.add_subplot()
        _draw_panel(ax, panel, [data])
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        renderer = canvas.get_renderer()
        assert ax.yaxis.get_offset_text().get_text() == "", panel.title  # nothing to add or multiply in a corner
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert len(set(labels)) == len(labels) >= 2, labels
        title, frame = ax.title.get_window_extent(renderer), figure.bbox
        assert frame.x0 <= title.x0 and title.x1 <= frame.x1 and title.y1 <= frame.y1, panel.title

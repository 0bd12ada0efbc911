"""docs/strategy.md says what was measured and estimated: each s/step figure is a row of docs/benchmarks.json (by
suite, variant and GPUs, to the digits shown), and its will_it_fit.py table is what the script prints (its bytes per
parameter: tests/test_strategy_bytes.py)."""
import importlib.util
import json
import re

from lessons import ROOT

PAGE = (ROOT / "docs" / "strategy.md").read_text()
GIB = 2 ** 30


def table(header: str) -> list[list[str]]:
    """The cells of every row of every table on the page whose header line is `header`."""
    rows, inside = [], False
    for line in PAGE.splitlines():
        if line.strip() == header:
            inside = True
        elif inside and line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
        elif not line.startswith("|"):
            inside = False
    return rows


def test_every_speed_on_the_page_is_a_row_of_benchmarks_json():
    measured = {(r["suite"], r["variant"], r["gpus"]): r["s_per_step"]
                for r in json.loads((ROOT / "docs" / "benchmarks.json").read_text())["rows"]
                if "s_per_step" in r and "variant" in r}
    rows = table("| suite | variant | GPUs | s/step |")
    assert len(rows) == 11 and {r[0] for r in rows} == {"tp", "pp"}
    for suite, variant, gpus, shown in rows:
        key = (suite, variant, int(gpus))
        assert key in measured and f"{measured[key]:.4f}" == shown, (key, shown, measured.get(key))
    assert not re.search(r"0\.0\d{3}", PAGE.replace("| 0.0", "")), "an s/step figure outside the tables"


def test_the_will_it_fit_table_is_what_the_script_estimates():
    spec = importlib.util.spec_from_file_location("will_it_fit", ROOT / "08_your_model" / "will_it_fit.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    config = fit.load_config(ROOT / "08_your_model" / "configs" / "llama3_8b.json")
    counted = fit.count(config)
    rows = table("| strategy | H100s (79.18 GiB) | sequence | tensors | fits at | verdict |")
    assert len(rows) == 4
    for strategy, gpus, seq, tensors, fits_at, verdict in rows:
        price = fit.price(config, strategy, int(gpus), 1, int(seq.replace(",", "")), counted=counted)
        assert (tensors, fits_at) == (f"{price.tensors / GIB:.1f} GiB", f"{price.fits_line / GIB:.1f} GiB")
        assert verdict.split(" (")[0] == price.verdict, (strategy, gpus, seq, verdict, price.verdict)
    layers = sum(fit.math.prod(s) for n, s in counted[0].items() if ".layers.0." in n)
    outside = sum(fit.math.prod(s) for n, s in counted[0].items() if ".layers." not in n)
    assert f"{outside / layers:.1f}x a decoder layer" in PAGE and "1.05 B parameters" in PAGE  # the root unit

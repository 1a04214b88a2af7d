"""The picture of runs (components/metrics/plot.py, `python -m scripts.plot`): what it draws from metrics.jsonl."""

import json

import matplotlib.image
import pytest

from components.metrics.plot import plot_runs
from scripts.plot import main


def fake_run(folder, losses, validation=()):
    folder.mkdir(parents=True)
    lines = [{"step": s, "loss": loss, "grad_norm": 1.0 / s, "lr": 1e-3 * s, "tokens_per_second": 100.0 + s}
             for s, loss in enumerate(losses, 1)]
    lines += [{"step": s, "val_loss": loss} for s, loss in validation]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_several_runs_go_on_one_png_and_a_folder_without_steps_is_named(tmp_path, capsys):
    a = fake_run(tmp_path / "a", [3.0, 2.5, 2.0], validation=[(3, 2.2)])
    b = fake_run(tmp_path / "b", [3.1, 2.9])
    (tmp_path / "empty").mkdir()
    assert plot_runs([a, b, tmp_path / "empty"], tmp_path / "both.png") == [a, b]
    assert matplotlib.image.imread(tmp_path / "both.png").shape[:2] == (520, 800)  # 10 x 6.5 in at 80 dpi
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["both.png"]  # no partial file left

    assert main([str(a), str(tmp_path / "empty"), "--output", str(tmp_path / "cli.png")]) == 0
    assert capsys.readouterr() == (f"plot of 1 run(s): {tmp_path / 'cli.png'}\n",
                                   f"no step logged in {tmp_path / 'empty'} (no metrics.jsonl, or an empty one)\n")
    assert main([str(b)]) == 0 and (b / "metrics.png").is_file()  # one run: beside its metrics.jsonl
    assert main([str(tmp_path / "empty")]) == 2
    with pytest.raises(SystemExit):  # several runs need a file to go to
        main([str(a), str(b)])


def test_a_run_that_logged_its_attention_logits_gets_a_panel_of_the_largest_over_its_layers(tmp_path, monkeypatch):
    import matplotlib.axes

    run = fake_run(tmp_path / "run", [3.0, 2.0])
    lines = [json.loads(line) | {"max_logit/layers.0.attention": 2.0 * s, "max_logit/layers.1.attention": 3.0 * s}
             for s, line in enumerate((run / "metrics.jsonl").read_text().splitlines(), 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    drawn = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda ax, *args, **kwargs: drawn.append(args) or plot(ax, *args, **kwargs))
    assert plot_runs([run], tmp_path / "logits.png") == [run]
    assert matplotlib.image.imread(tmp_path / "logits.png").shape[:2] == (520, 1200)  # 3 columns of panels
    assert drawn[-1] == ((1, 2), (3.0, 6.0))  # the last panel's line: each step's larger layer


def test_the_launcher_finds_the_run_s_folder_and_a_picture_it_cannot_write_costs_one_line(tmp_path, capsys):
    from components.run.launch import logged, picture_of_the_run, run_folder

    run = fake_run(tmp_path / "run", [3.0, 2.0])
    launch = ["--standalone", "--nproc_per_node", "2", "train.py", "--job.dump_folder", str(run)]
    assert run_folder(launch) == run and logged(run) == ((run / "metrics.jsonl").stat().st_size,
                                                         (run / "metrics.jsonl").stat().st_mtime_ns)
    assert run_folder([*launch, "--fault_tolerance.enable", "true", "--fault_tolerance.replica_id", "1"]) == \
        run / "replica_1"
    assert logged(tmp_path / "absent") is None and logged(None) is None
    picture_of_the_run(run)
    assert capsys.readouterr().err == f"plot of the run: {run / 'metrics.png'}\n"
    (run / "metrics.png").unlink()
    (run / "metrics.png").mkdir()  # in the way of the picture
    picture_of_the_run(run)
    assert capsys.readouterr().err.startswith("no plot of the run: IsADirectoryError: ")

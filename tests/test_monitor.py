import logging

import torch

from ampinit.monitor import TrainingMonitor
from conftest import make_setup, train_step


def test_monitor_records_skips_and_plots(tmp_path):
    model, opt = make_setup("O2", optimizer="sgd")
    monitor = TrainingMonitor(opt, total=6, desc="O2", show=False)
    for step in range(6):
        loss = train_step(model, opt, step, poison=(step == 3))
        monitor.update(loss)
    assert monitor.history["step"] == [1, 2, 3, 4, 5, 6]
    assert monitor.skipped_steps == [4]
    assert monitor.history["scale"] == [2.0 ** 16] * 3 + [2.0 ** 15] * 3
    baseline = TrainingMonitor(None, desc="fp32", show=False)
    baseline.update(torch.tensor(1.0))
    path = monitor.save_plot(str(tmp_path / "run.png"), others=[baseline])
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_monitor_logs_lines_without_tqdm(monkeypatch, caplog):
    import builtins
    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    model, opt = make_setup("O5", optimizer="sgd")
    with caplog.at_level(logging.INFO, logger="ampinit"):
        monitor = TrainingMonitor(opt, total=4, desc="O5", log_every=2)
        for step in range(4):
            monitor.update(train_step(model, opt, step))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["O5 step 2", "O5 step 4"]

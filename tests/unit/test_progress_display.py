"""The progress display's decisions, without MPI: when to print, what the line says, the ETA."""

import io

import pytest

from ringtrain.training.progress import (LineSchedule, Progress, choose_mode, eta_seconds, format_duration,
                                         progress_line)


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (45.9, "45s"), (72, "1m12s"), (3600, "1h00m"),
                                           (7500, "2h05m"), (3 * 86400 + 4 * 3600 + 59, "3d04h"), (-3, "0s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("master, enabled, tty, tqdm, mode", [
    (True, True, True, True, "bar"), (True, True, False, True, "lines"), (True, True, True, False, "lines"),
    (False, True, True, True, None), (True, False, False, True, None)])
def test_a_bar_only_on_a_terminal_and_only_on_rank_0(master, enabled, tty, tqdm, mode):
    assert choose_mode(master, enabled, tty, tqdm) == mode


def test_eta_from_the_rate_so_far_capped_by_max_time():
    assert eta_seconds(0, 0.0, 100) is None
    assert eta_seconds(50, 10.0, 100) == 20.0
    assert eta_seconds(50, 10.0, 100, time_left=5.0) == 5.0


def test_line_says_epoch_step_loss_rate_and_eta():
    assert progress_line(3, 30, 120, 500, 0.43214, 12345.6, 72) == \
        "epoch 3/30  step 120/500  loss 0.4321  12,346 samples/s  eta 1m12s"
    assert progress_line(1, 2, 0, 5, None, None, None) == "epoch 1/2  step 0/5"


def test_first_line_after_ten_seconds_then_every_interval_and_no_burst_after_a_pause():
    schedule = LineSchedule(30.0, start=100.0)
    assert not schedule.due(109.9) and schedule.due(110.0)
    assert not schedule.due(139.9) and schedule.due(140.0)
    assert schedule.due(400.0)  # a long evaluation: one line, then the interval again
    assert not schedule.due(401.0)
    assert LineSchedule(2.0, start=0.0).next == 2.0  # a short interval starts sooner than 10 s


def test_progress_prints_lines_on_its_clock():
    now, out = [0.0], io.StringIO()
    progress = Progress("lines", total=100, initial=0, epochs=2, steps_per_epoch=50, every=5.0, stream=out,
                        clock=lambda: now[0])
    for step in range(1, 21):
        now[0] = step * 0.6  # 0.6 s a step: lines due at 5 s, 10 s
        progress.update(step, 0, step, loss_sum=2.0 * 8, samples=8)
    lines = out.getvalue().splitlines()
    # 91 steps left at 0.6 s a step
    assert lines[0].startswith("epoch 1/2  step 9/50  loss 2.0000") and lines[0].endswith("13 samples/s  eta 54s")
    assert len(lines) == 2


def test_the_final_line_says_how_and_where_the_run_ended():
    from ringtrain.training.metrics import final_line

    assert final_line("done", 320, 10, 0, 32, 0.953) == "finished: step 320, 10 epochs done; test accuracy 95.30%"
    # Stopped one step into epoch 11: the epoch it was in, not the 10 it had completed.
    assert final_line("sigint", 321, 10, 1, 32, 0.9387) == \
        "stopped by SIGINT: step 321, in epoch 11 (step 1 of 32); test accuracy 93.87%"
    assert final_line("max_steps", 10, 0, 10, 40, None) == \
        "stopped at --max-steps: step 10, in epoch 1 (step 10 of 40); test accuracy n/a (the test set is empty)"
    assert final_line("max_time", 32, 1, 0, 32, 0.5).startswith("stopped at --max-time: step 32, 1 epoch done;")

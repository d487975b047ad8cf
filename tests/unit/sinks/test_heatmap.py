"""heatmap_visualize: TensorBoard images of the update/ratio histograms over steps, as msprobe's
HeatmapVisualizer draws them, checked against histograms recomputed in plain torch."""

from __future__ import annotations

import logging
import struct
import zlib

import pytest
import torch

from conftest import MLP, rank_dir
from msmon import TrainerMon
from msmon.collectors.optimizer_state import HIST_EDGES
from msmon.config import parse_config

STEPS = 5


def decode_png(data: bytes) -> torch.Tensor:
    """[H, W, 3] uint8 of an 8-bit RGB PNG with filter-0 rows (what msmon writes), decoded here."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        assert (
            zlib.crc32(kind + body) & 0xFFFFFFFF == struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]
        )
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour = header[:4]
    assert (depth, colour) == (8, 2)
    raw = torch.frombuffer(bytearray(zlib.decompress(idat)), dtype=torch.uint8).reshape(height, 1 + 3 * width)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(height, width, 3)


def independent_histograms(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """update and ratio histograms of every parameter after the step, from the optimizer state."""
    out = {}
    for name, p in model.named_parameters():
        state, group = optimizer.state[p], optimizer.param_groups[0]
        (beta1, beta2), eps, t = group["betas"], group["eps"], float(state["step"])
        m_hat = state["exp_avg"] / (1 - beta1**t)
        root_v = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt()
        ratio = torch.where(root_v > 0, m_hat / root_v, torch.zeros_like(m_hat))
        out[name] = {
            kind: torch.histc(t_.clamp(-1, 1), bins=len(HIST_EDGES) - 1, min=-1, max=1)
            for kind, t_ in (("adam_update", m_hat / (root_v + eps)), ("adam_ratio", ratio))
        }
    return out


def test_heatmap_images_are_buckets_by_steps_and_brightest_where_counts_peak(write_config, output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(3)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = TrainerMon(write_config({"ur_distribution": True, "heatmap_visualize": True, "format": "tensorboard"}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    expected = []  # per step: {param: {kind: counts}}
    for _ in range(STEPS):
        model(torch.randn(6, 8)).square().mean().backward()
        optimizer.step()
        expected.append(independent_histograms(model, optimizer))
        optimizer.zero_grad()
    mon.close()

    acc = EventAccumulator(str(rank_dir(output_dir)), size_guidance={"images": 0})
    acc.Reload()
    buckets = len(HIST_EDGES) - 1
    names = [n for n, _ in model.named_parameters()]
    assert sorted(acc.Tags()["images"]) == sorted(
        f"0:{n}/rank0/{k}" for n in names for k in ("adam_update", "adam_ratio")
    )
    for name in names:
        for kind in ("adam_update", "adam_ratio"):
            events = acc.Images(f"0:{name}/rank0/{kind}")
            assert [e.step for e in events] == list(range(STEPS))  # one image per recorded step, as msprobe
            for step, event in enumerate(events):
                image = decode_png(event.encoded_image_string)
                assert (event.height, event.width) == (buckets, step + 1) == tuple(image.shape[:2])
            counts = torch.stack([e[name][kind] for e in expected], dim=1)  # [buckets, steps]
            brightness = decode_png(events[-1].encoded_image_string).to(torch.int64).sum(dim=-1)
            # "hot" rises monotonically with the count: brightness orders as the counts do
            for col in range(STEPS):
                peak = counts[:, col] == counts.max()
                if peak.any():
                    assert (brightness[peak, col] == 255 * 3).all()  # the matrix maximum is white
                order = torch.argsort(counts[:, col], stable=True)
                assert (brightness[order, col].diff() >= 0).all(), (name, kind, col)
                assert brightness[counts[:, col].argmax(), col] == brightness[:, col].max()
            assert (brightness[counts == counts.min()] == brightness.min()).all()  # the minimum is darkest


def test_heatmap_without_the_key_writes_no_image(write_config, output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = TrainerMon(write_config({"ur_distribution": True, "format": "tensorboard"}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    model(torch.randn(6, 8)).square().mean().backward()
    optimizer.step()
    mon.close()
    acc = EventAccumulator(str(rank_dir(output_dir)))
    acc.Reload()
    assert acc.Tags()["images"] == [] and acc.Tags()["histograms"]


@pytest.mark.parametrize(
    "cfg, why",
    [
        ({"heatmap_visualize": True}, "ur_distribution is not true"),
        ({"heatmap_visualize": True, "ur_distribution": True, "format": "csv"}, "format has no 'tensorboard'"),
    ],
)
def test_heatmap_without_its_inputs_warns_in_one_line(caplog, cfg, why):
    caplog.set_level(logging.WARNING, logger="msmon")
    logging.getLogger("msmon").propagate = True
    assert parse_config(cfg).heatmap_visualize is True
    messages = [r.getMessage() for r in caplog.records if "heatmap_visualize" in r.getMessage()]
    assert len(messages) == 1 and why in messages[0] and "\n" not in messages[0]


def test_heatmap_visualize_must_be_a_bool():
    from msmon.config import ConfigError

    with pytest.raises(ConfigError, match="heatmap_visualize: expected true or false"):
        parse_config({"heatmap_visualize": "yes"})
    assert parse_config({"heatmap_visualize": True, "ur_distribution": True}).heatmap_visualize is True

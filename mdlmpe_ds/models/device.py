"""The inference tools' ``--device``: checked before any weight is read, so that a device this
machine does not have is named with what to use instead, not reported by torch's assertion
("Torch not compiled with CUDA enabled") after minutes of loading."""

from __future__ import annotations

import torch


def check_device(device: str | torch.device, flag: str = "--device") -> torch.device:
    """``device`` as a ``torch.device`` when this process can allocate on it, else a ValueError
    naming ``flag``, the reason and the devices that work here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{flag} {device!r} is not a torch device ({err}); use cpu or cuda[:N]") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA support"
                if torch.version.cuda is None
                else f"torch (CUDA {torch.version.cuda}) sees no GPU: no driver, or CUDA_VISIBLE_DEVICES "
                "hides them"
            )
            raise ValueError(f"{flag} {device}: no CUDA GPU is usable here ({why}); use {flag} cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"{flag} {device}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
            )
        return dev
    if dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except (AssertionError, RuntimeError) as err:
            raise ValueError(f"{flag} {device}: not usable here ({err}); use {flag} cpu") from err
    return dev

"""The harness: runs, analysis, calibration, tree choice.

Importing it registers the config resolvers ``${on_device:DEVICE,CPU_VALUE,CUDA_VALUE}``, which picks a
default by the device type ``device=`` resolves to, for a method whose best setting differs between the
two (``conf/method/eagle.yaml``'s tree; the run header records the resolved value), and
``${unless:VALUE,DEFAULT}``: ``-VALUE``, or nothing where VALUE is DEFAULT, for a label that names a setting
only where it is not the default (``conf/method/eagle.yaml``'s draft).
"""

import torch
from omegaconf import OmegaConf


def _on_device(device: str, cpu: object, cuda: object) -> object:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return cuda if str(device).startswith("cuda") else cpu


def _unless(value: object, default: object) -> str:
    return "" if value == default else f"-{value}"


OmegaConf.register_new_resolver("on_device", _on_device, replace=True)
OmegaConf.register_new_resolver("unless", _unless, replace=True)

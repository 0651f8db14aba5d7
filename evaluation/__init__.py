"""The harness: runs, analysis, calibration, tree choice.

Importing it registers the config resolver ``${on_device:DEVICE,CPU_VALUE,CUDA_VALUE}``, which picks a
default by the device type ``device=`` resolves to, for a method whose best setting differs between the
two (``conf/method/eagle.yaml``'s tree). The run header records the resolved value.
"""

import torch
from omegaconf import OmegaConf


def _on_device(device: str, cpu: object, cuda: object) -> object:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return cuda if str(device).startswith("cuda") else cpu


OmegaConf.register_new_resolver("on_device", _on_device, replace=True)

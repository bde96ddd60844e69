"""A script that makes its own default process group before leto_runtime.init()."""
import torch.distributed as dist

import leto_runtime as leto

dist.init_process_group("gloo")
leto.init(device="cpu")

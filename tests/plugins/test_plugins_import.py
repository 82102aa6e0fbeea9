"""``macattn.plugins`` imports on machines without triton (CI); ``register_kernels`` then registers
nothing and the ops run their reference."""
import subprocess
import sys


def test_import_without_triton_registers_nothing():
    code = ("import sys; sys.modules['triton'] = None\n"      # makes `import triton` raise ImportError
            "import macattn.plugins as p, macattn.plugins.mac\n"
            "from macattn.methods.kernels import register_kernels, registered_kernels\n"
            "assert p.HAVE_TRITON is False and register_kernels() == () and not registered_kernels()\n"
            "import torch, macattn.methods.mac.ops\n"
            "q = torch.randn(1, 2, 8)\n"
            "mp, dist = torch.ops.macattn.mac_match(q, torch.randn(1, 2, 4, 8), torch.zeros(1, 2, 4),\n"
            "    torch.full((1, 4), -1), torch.zeros(1, dtype=torch.long), torch.tensor([3]), 1, 0.5)\n"
            "assert (mp == -1).all()\n")
    subprocess.run([sys.executable, "-c", code], check=True)

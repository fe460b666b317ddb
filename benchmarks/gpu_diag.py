"""Diagnostic (GPU): every block recomputed (ours) against Hugging Face every-layer checkpointing."""
import sys, warnings
warnings.filterwarnings("ignore")
import torch
sys.path.insert(0, "benchmarks")
import gpu_check
from lightning_remat import profile_step, apply_plan
from lightning_remat.core.memory_model import predict_peak

dev = torch.device("cuda")
meter = gpu_check.Meter(dev)
for name in sys.argv[1:] or ["gpt2"]:
    case = build = None
    from lightning_remat.models import build
    case = build(name, **gpu_check.GPU_MODELS[name])
    case.model.config.use_cache = False
    base, step = gpu_check._on_device(case, dev)
    model, opt = gpu_check._fresh(base)
    p = profile_step(model, step, optimizer=opt)
    whole = [s.options.index(s.option("whole")) for s in p.stages]
    print(name, "stages", len(p.stages), "options", [o.name for o in p.stages[0].options])
    print(" predicted all-whole", predict_peak(p, whole) / 2**30, "keep", p.baseline_peak_bytes / 2**30)
    for s in p.stages[:2]:
        print(" ", s.name, [(o.name, round(o.stored_bytes / 2**20, 1), round(o.local_peak_bytes / 2**30, 3)) for o in s.options])
    print("  segments", [(g.name, g.stages_alive, round(g.peak_bytes / 2**30, 3)) for g in p.segments])
    apply_plan(model, [s.name for s in p.stages])
    meter.clear()
    print(" ours all-whole", [round(meter.step(model, step, opt)[0] / 2**30, 3) for _ in range(4)])
    del model, opt; meter.clear()
    model, opt = gpu_check._fresh(base)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    print(" hf", [round(meter.step(model, step, opt)[0] / 2**30, 3) for _ in range(4)])
    ckpt = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)]
    print(" hf checkpointed modules", len(ckpt), ckpt[:3])
    del model, opt; meter.clear()

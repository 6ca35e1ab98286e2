"""Reference optimiser steps for examples/llama/tests/optim.rs: torch.optim.AdamW and transformers'
Adafactor run on the parameters and gradients given as JSON; prints the parameters after each
step as JSON.

Request: {"optimizer": "adamw" | "adafactor", "lr": [..per step..], "weight_decay": x,
          "beta1": null | x, "scale_parameter": bool,
          "params": {name: {"shape": [...], "data": [...]}},
          "grads": [ {name: [...flat...]} per step ]}
"""
import json
import sys

import torch
from transformers.optimization import Adafactor


def main():
    req = json.load(open(sys.argv[1]))
    names = sorted(req["params"])
    params = {
        n: torch.nn.Parameter(torch.tensor(req["params"][n]["data"], dtype=torch.float32).reshape(req["params"][n]["shape"]))
        for n in names
    }
    plist = [params[n] for n in names]
    if req["optimizer"] == "adamw":
        opt = torch.optim.AdamW(plist, lr=req["lr"][0], betas=(0.9, 0.999), eps=1e-8, weight_decay=req["weight_decay"])
    else:
        opt = Adafactor(
            plist,
            lr=req["lr"][0],
            beta1=req.get("beta1"),
            weight_decay=req["weight_decay"],
            scale_parameter=req["scale_parameter"],
            relative_step=False,
            warmup_init=False,
        )
    out = []
    for lr, grads in zip(req["lr"], req["grads"]):
        for g in opt.param_groups:
            g["lr"] = lr
        for n in names:
            params[n].grad = torch.tensor(grads[n], dtype=torch.float32).reshape(params[n].shape)
        opt.step()
        out.append({n: params[n].detach().flatten().tolist() for n in names})
    json.dump({"steps": out}, sys.stdout)


if __name__ == "__main__":
    main()

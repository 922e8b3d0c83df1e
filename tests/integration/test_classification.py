"""A classifier trained under hmp reaches fp32's accuracy.

scikit-learn's bundled handwritten digits (1,797 8x8 images, shipped inside
the package, no download); a small MLP trained from the same seed in fp32
and under hmp.convert(), optimizer steps under hmp.disable_casts().
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp

datasets = pytest.importorskip("sklearn.datasets")
model_selection = pytest.importorskip("sklearn.model_selection")


# A model this small gains nothing from threads, and on a busy 2-core
# runner two OpenMP threads waiting on each other make it ~15x slower.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def digits():
    x, y = datasets.load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = model_selection.train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    x_tr, x_te = torch.tensor(x_tr, dtype=torch.float32), torch.tensor(x_te, dtype=torch.float32)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1.0  # +1: some border pixels are always 0
    return (x_tr - mean) / std, torch.tensor(y_tr), (x_te - mean) / std, torch.tensor(y_te)


def fit(x_tr, y_tr, x_te, y_te, seed=0, epochs=40, batch=64):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    order = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(x_tr), generator=order).split(batch):
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad()
            loss.backward()
            with hmp.disable_casts():
                opt.step()
        with hmp.disable_casts():
            sched.step()
    model.eval()
    with torch.no_grad():
        logits = model(x_te)
    return logits, 100.0 * (logits.argmax(1) == y_te).float().mean().item()


def test_mlp_on_digits_hmp_accuracy_within_one_point_of_fp32():
    data = digits()
    _, acc32 = fit(*data)
    hmp.convert()
    try:
        logits, acc_hmp = fit(*data)
    finally:
        hmp.revert()
    assert logits.dtype == torch.bfloat16  # the model really ran in bf16 under hmp
    assert acc32 > 90.0 and acc_hmp > 90.0  # chance is 10%
    assert abs(acc_hmp - acc32) <= 1.0, (acc32, acc_hmp)

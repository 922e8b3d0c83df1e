"""A tiny diffusers UNet2DModel trained a few steps and sampled with a DDIM scheduler under hmp.

Shows: the UNet computes in bfloat16 where the lists say, its timestep embedding runs in
float32 (a module entry of hmp's default FP32 list), the weights and their gradients stay
float32, and the scheduler's step runs uncast, so the latents of the sampling loop stay
float32 instead of being rounded to bfloat16 at every step.

Run:  python examples/diffusers_unet.py
Needs diffusers:  pip install diffusers
"""

import torch
import torch.nn.functional as F

try:
    from diffusers import DDIMScheduler, UNet2DModel
except ImportError as error:
    raise ImportError("this example needs diffusers: pip install diffusers") from error

import hmp


def main():
    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )
    scheduler = DDIMScheduler(num_train_timesteps=100)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    # "images": smooth 8x8 blobs, the data the UNet learns to denoise
    grid = torch.linspace(-1, 1, 8)
    centers = torch.rand(32, 2) - 0.5
    images = (
        torch.exp(
            -(
                (grid[None, :, None] - centers[:, None, None, 0]) ** 2
                + (grid[None, None, :] - centers[:, None, None, 1]) ** 2
            )
            * 4
        )[:, None]
        * 2
        - 1
    )

    embedding_dtypes = []
    unet.time_embedding.register_forward_hook(lambda module, args, out: embedding_dtypes.append(out.dtype))

    hmp.convert()
    try:
        for step in range(10):
            noise = torch.randn_like(images)
            t = torch.randint(0, scheduler.config.num_train_timesteps, (len(images),))
            noisy = scheduler.add_noise(images, noise, t)
            predicted = unet(noisy, t).sample
            loss = F.mse_loss(predicted, noise)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 3 == 0 or step == 9:
                print(f"training step {step}: loss {loss.item():.4f}")
        print(f"UNet output: {predicted.dtype}; time embedding output: {embedding_dtypes[0]}; loss: {loss.dtype}")
        print(
            f"weights: {sorted({str(p.dtype) for p in unet.parameters()})}, "
            f"gradients: {sorted({str(p.grad.dtype) for p in unet.parameters()})}"
        )

        scheduler.set_timesteps(5)
        sample = torch.randn(2, 1, 8, 8)
        unet.eval()
        with torch.no_grad():
            for t in scheduler.timesteps:
                noise_pred = unet(sample, t).sample
                with hmp.disable_casts():  # the same step with casts off, for comparison
                    reference = scheduler.step(noise_pred, t, sample).prev_sample
                sample = scheduler.step(noise_pred, t, sample).prev_sample  # runs uncast by itself
                print(
                    f"sampling t={int(t):2d}: noise prediction {noise_pred.dtype}, latents {sample.dtype}, "
                    f"difference from the uncast step {(sample - reference).abs().max().item():.1e}"
                )
    finally:
        hmp.revert()


if __name__ == "__main__":
    main()

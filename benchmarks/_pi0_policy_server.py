"""LeRobot's async-inference `PolicyServer` for π0 / π0.5 policies, as a lab runs it, on this stack.

LeRobot's π0 classes need openpi's patched transformers (`joynexus.artifacts.openpi_transformers`);
a lab installs that wheel, we apply the same patch for the server's lifetime. Policies whose Gemma
shapes are not LeRobot's published variants (the small ones of a quick run) are loaded with those
shapes registered (`lerobot_variants`), read from the PaliGemma directory given by
``JOYNEXUS_PI0_PALIGEMMA`` and the expert shape in ``JOYNEXUS_PI0_EXPERT`` ("width,depth,mlp,heads,
kv_heads,head_dim"). Every other argument is the PolicyServer's own (``--host``, ``--port``, ...):

    python benchmarks/_pi0_policy_server.py --host=127.0.0.1 --port=8080
"""

from __future__ import annotations

import contextlib
import os


def main() -> None:
    from joynexus.artifacts.openpi_transformers import openpi_transformers

    with contextlib.ExitStack() as stack:
        stack.enter_context(openpi_transformers())
        paligemma, expert = os.environ.get("JOYNEXUS_PI0_PALIGEMMA"), os.environ.get("JOYNEXUS_PI0_EXPERT")
        if paligemma and expert:
            from transformers import PaliGemmaConfig

            from joynexus.artifacts.lerobot_pi0 import gemma_shape, lerobot_variants

            config = PaliGemmaConfig.from_pretrained(paligemma, local_files_only=True)
            vlm = gemma_shape(config.text_config)
            shape = tuple(int(v) for v in expert.split(","))
            for kind in ("pi0", "pi05"):
                stack.enter_context(lerobot_variants(kind, vlm, shape, config))
        from lerobot.async_inference.policy_server import serve

        serve()


if __name__ == "__main__":
    main()

"""Where the roles run: the device plan and its offline CLI (`python -m launcher.planning.plan`), the size rule
of a layout (`layout`), the auto-placement search (`autoplan`), the cost model (`costmodel`, `stepmodel`) and
its per-machine calibration (`calibration/*.json`)."""

"""torch.autograd.anomaly_mode's names: `detect_anomaly`, `set_detect_anomaly`, with
`is_anomaly_enabled`, `is_anomaly_check_nan_enabled` (torch's `torch.is_anomaly_*`),
`AnomalyError` and `anomaly_checked` (implemented in `jamp.transforms.anomaly`)."""

from jamp.transforms.anomaly import (AnomalyError, anomaly_checked, detect_anomaly,
                                     is_anomaly_check_nan_enabled, is_anomaly_enabled,
                                     set_detect_anomaly)

__all__ = ["AnomalyError", "anomaly_checked", "detect_anomaly", "is_anomaly_check_nan_enabled",
           "is_anomaly_enabled", "set_detect_anomaly"]

"""calibration: times each device on the real model and fits its step-time curve.

Importing this package does not import TensorFlow: the TF parts (calibrate, probe, models) import it when called.
"""

from calibration.calibrate import calibrate
from calibration.fit import FitResult, fit_cost_model
from calibration.models import build_model
from calibration.probe import DeviceProbe, input_signature, model_fingerprint, preserved_model_state
from calibration.result import CalibrationResult, DeviceProfile
from calibration.store import ProfileStore, default_cache_dir, load_result_file, profile_key, save_result_file
from calibration.timing import TimingStats, probe_batch_sizes, summarize_trials

__all__ = ["CalibrationResult", "DeviceProbe", "DeviceProfile", "FitResult", "ProfileStore", "TimingStats",
           "build_model", "calibrate", "default_cache_dir", "fit_cost_model", "input_signature", "load_result_file",
           "model_fingerprint", "preserved_model_state", "probe_batch_sizes", "profile_key", "save_result_file",
           "summarize_trials"]

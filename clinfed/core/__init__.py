"""The infrastructure every layer above stands on: errors and how a setting
is named in one, progress events, the settings' schema helpers, run folders
(claimed, written atomically, sealed), the private scratch folder, devices
and threads, provenance and public-input checks, tensors on the wire,
experiment tracking. Imports nothing of clinfed but the privacy library."""

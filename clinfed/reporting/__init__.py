"""What a run shows a person: the privacy report (``clinfed report``), the
membership-inference audit (``clinfed audit``) and the epsilon / noise
calculator (``clinfed privacy``). Built on the leaf library
``clinfed.privacy`` and on run folders; nothing here trains or releases."""

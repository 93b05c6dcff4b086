"""Mode speculate: tokens ordered, on the device, to the rank predicted to hold their experts.

The parts: :mod:`.plan` decides the layout and predictor once (and refuses what cannot be
ordered); :class:`~.token_order.TokenOrder` is the device state every layout shares; the layouts
(:mod:`.layout_block`: per block, shuffled reduce-scatter; :mod:`.layout_stack`: the DeepSeek
family per layer or per step) own their hooks and op bodies; the predictors
(:mod:`.predictors`) guess each token's rank; :mod:`.comm` holds the static-shape collectives'
helpers, :mod:`.seams` and :mod:`.gates` what is read of the model; the placement's maps and
tables come from the worker's :class:`~..location.DeviceLocation`."""

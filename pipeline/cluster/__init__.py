"""Ray layer (the only package that imports Ray): actor pool and driver.

Import the submodules (`pipeline.cluster.driver`, ...) directly; importing this package alone
does not import Ray.
"""

"""meshnode.mesh"""

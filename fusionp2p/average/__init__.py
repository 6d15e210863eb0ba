"""average"""

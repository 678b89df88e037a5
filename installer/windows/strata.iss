; Inno Setup 6 script for Strata: a per-user installer with a Start-menu entry, an optional
; "start at login" task and an uninstaller. NOT RUN ON WINDOWS. Compiled with ISCC and run
; silently under wine in CI (tests/installer/test_inno_wine.py), with a stand-in for PowerShell
; (wine has none), so install.ps1 itself is not run there; see docs/getting-started.md.
;
; Build, from the repository root on Windows:
;   pip wheel --no-deps -w dist .
;   iscc installer\windows\strata.iss          -> dist\strata-setup.exe
;
; The setup carries Strata's wheel and install.ps1. Before any file is installed
; (PrepareToInstall, [Code] below) install.ps1 stops a running Strata of this installation,
; creates a virtualenv in {app}\venv with the user's Python 3.11+ (`py -0p`), installs PyTorch
; (CUDA build where an NVIDIA driver is present) and then the wheel. A failing step stops the
; setup with install.ps1's reason (exit code 7 when silent), so no shortcut or "Start now" can
; point at a virtualenv that does not exist. Python itself is not bundled.
;
; ISCC /DPowerShell=... replaces powershell.exe (the test's double, which succeeds or fails on
; purpose).

#define AppName "Strata"
#define AppVersion "0.1.0"
#define Wheel "strata-" + AppVersion + "-py3-none-any.whl"
#ifndef PowerShell
  #define PowerShell "{sys}\WindowsPowerShell\v1.0\powershell.exe"
#endif

[Setup]
AppId={{5B0C7E0A-3E7C-4B8E-9A59-7A4C2F1D6E21}
AppName={#AppName}
AppVersion={#AppVersion}
AppPublisher=Strata contributors
AppComments=Local LLM server in the tray that gives GPU memory back when other apps need it
DefaultDirName={localappdata}\Programs\Strata
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
OutputDir=..\..\dist
OutputBaseFilename=strata-setup
Compression=lzma2
SolidCompression=yes
WizardStyle=modern
UninstallDisplayName={#AppName}
UninstallDisplayIcon={app}\strata.ico
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible

[Tasks]
Name: "autostart"; Description: "Start Strata when I log in"; Flags: unchecked
Name: "cpuonly"; Description: "No NVIDIA GPU: install the CPU build of PyTorch (smaller)"; Flags: unchecked

[Files]
Source: "install.ps1"; DestDir: "{app}"; Flags: ignoreversion
Source: "..\..\dist\{#Wheel}"; DestDir: "{app}"; Flags: ignoreversion
Source: "..\..\LICENSE"; DestDir: "{app}"; Flags: ignoreversion skipifsourcedoesntexist

[Icons]
; pythonw: the tray opens no console window. strata.ico is rendered by install.ps1.
Name: "{autoprograms}\Strata"; Filename: "{app}\venv\Scripts\pythonw.exe"; Parameters: "-m strata.app.main"; WorkingDir: "{app}"; IconFilename: "{app}\strata.ico"; Comment: "Local LLM server that shares the GPU"

[Run]
Filename: "{app}\venv\Scripts\pythonw.exe"; Parameters: "-m strata.app.main"; \
  Description: "Start Strata now"; Flags: nowait postinstall skipifsilent

[UninstallDelete]
Type: filesandordirs; Name: "{app}\venv"
Type: files; Name: "{app}\strata.ico"

[Code]
function TaskSwitches: String;
begin
  Result := '';
  if WizardIsTaskSelected('autostart') then
    Result := Result + ' -Autostart';
  if WizardIsTaskSelected('cpuonly') then
    Result := Result + ' -CpuOnly';
end;

{ Runs install.ps1 and says why it failed: PowerShell could not start, or the script's own
  reason (it writes it to -ErrorFile before exiting with 1), or its bare exit code. }
function RunInstallScript(const Script, Arguments, What: String; var Reason: String): Boolean;
var
  ResultCode: Integer;
  ErrorFile: String;
  Message: AnsiString;
begin
  ErrorFile := ExpandConstant('{tmp}\install-error.txt');
  DeleteFile(ErrorFile);
  Log('Running ' + Script + ' ' + Arguments);
  Result := False;
  if not Exec(ExpandConstant('{#PowerShell}'),
      '-NoProfile -ExecutionPolicy Bypass -File "' + Script + '" ' + Arguments +
      ' -ErrorFile "' + ErrorFile + '"', '', SW_HIDE, ewWaitUntilTerminated, ResultCode) then
    Reason := What + ' failed: PowerShell could not be started (' + SysErrorMessage(ResultCode) + ')'
  else if ResultCode <> 0 then
  begin
    if LoadStringFromFile(ErrorFile, Message) and (Trim(String(Message)) <> '') then
      Reason := What + ' failed: ' + Trim(String(Message))
    else
      Reason := What + ' failed with exit code ' + IntToStr(ResultCode);
  end
  else
    Result := True;
  if not Result then
    Log(Reason);
end;

{ The whole installation of the virtualenv happens here, before Inno installs any file: a
  non-empty result stops the setup with that message. }
function PrepareToInstall(var NeedsRestart: Boolean): String;
var
  Reason: String;
begin
  Result := '';
  ExtractTemporaryFile('install.ps1');
  ExtractTemporaryFile('{#Wheel}');
  if not RunInstallScript(ExpandConstant('{tmp}\install.ps1'),
      '-Prefix "' + ExpandConstant('{app}') + '" -Source "' + ExpandConstant('{tmp}\{#Wheel}') +
      '" -NoShortcut' + TaskSwitches, 'Installing Strata and PyTorch', Reason) then
    Result := Reason;
end;

{ Uninstall: install.ps1 stops a running tray, removes the login entry and the virtualenv;
  Inno then removes the files it installed. A failure is reported, not hidden. }
procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
var
  Reason: String;
begin
  if CurUninstallStep = usUninstall then
    if not RunInstallScript(ExpandConstant('{app}\install.ps1'),
        '-Uninstall -NoShortcut -Prefix "' + ExpandConstant('{app}') + '"',
        'Removing Strata''s virtualenv', Reason) then
      SuppressibleMsgBox(Reason + '. Close Strata and delete ' + ExpandConstant('{app}') +
        ' by hand.', mbError, MB_OK, IDOK);
end;
